"""The ``plan`` section's markdown: the conditions, per budget the plan beside transformers'
checkpointing of every layer, of every n-th layer and torch.compile's activation_memory_budget
(measured peak, whether it fits, added FLOPs, step time), the targets met and missed, and every
configuration measured. Input: the results dict of ``ckpt_ext.bench.plan_section``."""
from __future__ import annotations

from ..planner.units import OPTIONS
from .report import fmt_bytes

ROW_METHODS = (("plan", "ckpt_ext.plan"),
               ("plan-compiled", "ckpt_ext.plan(compiled=True), Plan.compile"),
               ("hf-every-layer", "transformers, every layer"),
               ("hf-every-n", "transformers, every n-th layer (largest n that fits)"),
               ("compile", "torch.compile, activation_memory_budget (largest that fits)"))


def conditions_line(res: dict) -> str:
    c, s = res["conditions"], res["sizes"]
    tokens = s["batch"] * s["seq"]
    return (f"Benchmark conditions: {c['device']}, {c['dtype']}, torch {c['torch']}, "
            f"transformers {c.get('transformers', '?')}; transformers' LlamaForCausalLM from a "
            f"config: {s['layers']} layers, hidden {s['hidden']}, intermediate "
            f"{s['intermediate']} (gated SiLU), {s['heads']} heads (multi-head attention, "
            f"sdpa), vocabulary {s['vocab']}; {s['batch']} sequences of {s['seq']} tokens "
            f"({tokens:,} tokens), loss on next-token labels, train mode. Memory = "
            f"{c['memory_meter']}, one step per configuration "
            f"(`ckpt_ext.planner.measure_step`); FLOPs = `FlopCounterMode` per step (a "
            f"compiled step's counted on its partitioned graphs run eagerly); step time = median "
            f"of {s['steps']} steps after {s['warmup']} warm-up, configurations interleaved, "
            f"counting allocator uninstalled; × plain = the median over rounds of the step over "
            f"plain's step in the same round (each compiled configuration in a loop of its own "
            f"with plain); compile backend "
            f"{c['compile_backend']}. Budgets from plain's peak down to the least any plan "
            f"reaches. Command: `{c['command']}`.")


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def markdown(res: dict) -> str:
    configs, plain = res["configs"], res["configs"]["plain"]
    plain_flops = plain["flops"]
    lines = [conditions_line(res), "",
             "| budget | method | configuration | measured peak | fits | predicted peak "
             "| added FLOPs (of plain's step) | step × plain |",
             "|---:|---|---|---:|---|---:|---:|---:|"]
    for row in res["rows"]:
        b = row["budget"]
        for key, label in ROW_METHODS:
            if key not in res["methods"] and not (key.startswith("hf") and
                                                  "hf-every-layer" in res["methods"]):
                continue
            name = row.get(key)
            if name is None:
                lines.append(f"| {fmt_bytes(b)} | {label} | none fits | | no | | | |")
                continue
            r = configs[name]
            predicted = row.get("plan-compiled_predicted") if key == "plan-compiled" \
                else r.get("predicted_peak")
            pred = fmt_bytes(predicted) if predicted else ""
            t = f"{r['time_vs_plain']:.2f}" if r.get("time_vs_plain") else "n/a"
            lines.append(f"| {fmt_bytes(b)} | {label} | {name} | {fmt_bytes(r['peak'])} "
                         f"| {'yes' if r['peak'] <= b else '**no**'} | {pred} "
                         f"| {r['added_flops']:,} ({_pct(r['added_flops'] / plain_flops)}) "
                         f"| {t} |")
    lines += ["", "Targets:", ""]
    for what, t in res["targets"].items():
        met = {True: "**met**", False: "**missed**", None: "not tested (no such budget)"}[t["met"]]
        detail = ", ".join(f"{k}: {_fmt(v)}" for k, v in t.items() if k != "met")
        lines.append(f"- {what}: {met} ({detail})")
    lines += ["", f"Planning: `ckpt_ext.plan` took {res['plan_survey_s']:.1f} s (its probe "
              f"steps), and " + ", ".join(f"{r['plan_seconds']:.1f}" for r in res["rows"])
              + " s at the budgets above" + (
                  "; `plan(compiled=True)` " + ", ".join(
                      f"{r['plan-compiled_seconds']:.1f}" for r in res["rows"]) + " s"
                  if any("plan-compiled_seconds" in r for r in res["rows"]) else "") + ".", "",
              "Every configuration measured (`plan` + letters per layer, then the head's: "
              + ", ".join(f"{row.short} {o.value}" for o, row in OPTIONS.items())
              + "; `plan compiled`: the compiled plan, applied and compiled):", "",
              "| configuration | peak | kept for backward | added FLOPs | step ms | × plain |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, r in configs.items():
        t = f"{r['time_vs_plain']:.2f}" if r.get("time_vs_plain") else "n/a"
        ms = f"{r['step_ms']:.1f}" if r.get("step_ms") else "n/a"
        lines.append(f"| {name} | {fmt_bytes(r['peak'])} | {fmt_bytes(r['kept'])} "
                     f"| {r['added_flops']:,} | {ms} | {t} |")
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)
