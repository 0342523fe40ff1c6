"""The benchmark's markdown: the conditions line, the table of every mode per network (memory
kept and peak, step time against plain and the floor, the front, gradient error, max batch), the
targets met and missed, and the write-up's four readings. Input: the results dict that
:func:`ckpt_ext.bench.orchestrate.run` returns.
"""
from __future__ import annotations

from typing import Optional

from ..models import NETWORKS, is_pinn
from .presets import READINGS


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    if abs(n) < 2**20:
        return f"{n / 2**10:,.1f} KiB"
    return f"{n / 2**20:,.2f} MiB"


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """The names whose (time, memory) no other point matches or beats on both with one strictly
    better: the modes that are cheapest for their memory."""
    front = []
    for name, (t, m) in points.items():
        if not any((t2 <= t and m2 <= m) and (t2 < t or m2 < m)
                   for other, (t2, m2) in points.items() if other != name):
            front.append(name)
    return sorted(front, key=lambda n: points[n])


def conditions_line(c: dict) -> str:
    s, p, b = c["sizes"], c["pinn_sizes"], c["bert_sizes"]
    pinns = [n for n in NETWORKS if is_pinn(n)]
    return (
        f"Benchmark conditions: {c['device']}, {c['dtype']}, torch {c['torch']}; "
        f"chain/residual/mlp: batch {s['batch']}, in_features {s['in_features']}, hidden "
        f"{s['hidden']}, depth {s['depth']} (MLP inner {c['mlp_ratio']}×hidden); bert-mlp: "
        f"{b['batch']} tokens, {b['depth']} blocks of {b['in_features']} -> {b['hidden']} -> "
        f"{b['in_features']} (GELU), residual and LayerNorm; {_llama(c)}{', '.join(pinns)}: "
        f"{p['in_features']} -> {p['hidden']}x{p['depth']} -> {p['out_features']} MLP "
        f"({', '.join(NETWORKS[n].ACTIVATION for n in pinns)}) on {p['batch']} points. "
        f"Step time = median of {c['steps']} steps after {c['warmup']} warm-up, modes interleaved, "
        f"counting allocator uninstalled; floor = plain's step + the GEMMs the mode recomputes, "
        f"timed alone in the same loop; memory = {c['memory_meter']}, from separate steps; "
        f"torch.compile backend {c['compile_backend']}; budget {fmt_bytes(c['budget_bytes'])} "
        f"(bert-mlp: {fmt_bytes(c['bert_budget_bytes'])}"
        + (f", llama-mlp and the LoRA networks: {fmt_bytes(c['llama_budget_bytes'])}"
           if "llama_budget_bytes" in c else "")
        + (f", moe: {fmt_bytes(c['moe_budget_bytes'])}" if "moe_budget_bytes" in c else "")
        + f"). Command: `{c['command']}`.")


def _llama(c: dict) -> str:
    """llama-mlp's, the LoRA networks' and moe's sizes, where the results have them."""
    lm, moe = c.get("llama_sizes"), c.get("moe_sizes")
    out = ""
    if lm:
        lora = NETWORKS["llama-lora"]
        out += (f"llama-mlp: {lm['batch']} tokens, {lm['depth']} blocks of RMSNorm and "
                f"{lm['in_features']} -> 2×{lm['hidden']} -> {lm['in_features']} (gated SiLU), "
                f"residual; llama-lora, llama-lora-dropout: the same, base weights frozen, "
                f"LoRA r {lora.RANK}, alpha {lora.ALPHA} on gate, up and down, lora_dropout "
                f"{lora.DROPOUT:g} and {NETWORKS['llama-lora-dropout'].DROPOUT:g}; ")
    if moe:
        cls = NETWORKS["moe"]
        out += (f"moe: {moe['batch']} tokens, {moe['depth']} blocks of RMSNorm and "
                f"{cls.EXPERTS} experts of {moe['in_features']} -> 2×{moe['hidden']} -> "
                f"{moe['in_features']} (gated SiLU), top-{cls.TOP_K}, residual; ")
    return out


def _targets(results: dict) -> list[str]:
    """The targets section: per network, each target met or missed with its figures."""
    lines = []
    for net_name, met in results.get("targets", {}).items():
        lines += ["", f"Targets, {net_name} (fused; same run):", ""]
        for what, t in met.items():
            word = {True: "**met**", False: "**missed**", None: "not tested"}[t["met"]]
            figures = ", ".join(f"{k}: {_figure(k, v)}" for k, v in t.items() if k != "met")
            lines.append(f"- {what}: {word} ({figures})")
    return lines


def _figure(key: str, v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if key in ("ratio", "share") or key.startswith("step_ratio"):
        return f"{v:.3g}"
    if key.endswith("_ms"):
        return f"{v:.1f} ms"
    if key.endswith("_bytes"):
        return fmt_bytes(v)
    return f"{v:,}"


def _fronts(modes: dict) -> dict[str, list[str]]:
    ok = {m: r for m, r in modes.items() if r.get("time_vs_plain") is not None}
    return {what: pareto_front({m: (r["time_vs_plain"], r[key]) for m, r in ok.items()})
            for what, key in (("kept", "kept_for_backward"),
                              ("peak", "peak_above_before_forward"))}


def markdown(results: dict) -> str:
    lines = [conditions_line(results["conditions"]), "",
             "| network | mode | kept for bwd | peak (above before fwd) | step ms | × plain "
             "| floor ms | × floor | on the front | grad rel err | max batch in budget |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for net_name, modes in results["networks"].items():
        fronts = _fronts(modes)
        for mode, r in modes.items():
            if "same_as" in r:
                lines.append(f"| {net_name} | {mode} | = {r['same_as']} ({r['why']}) |"
                             + " |" * 8)
                continue
            if "error" in r:
                lines.append(f"| {net_name} | {mode} | n/a ({r['error']}) |" + " |" * 8)
                continue
            ratio = f"{r['time_vs_plain']:.2f}" if r.get("time_vs_plain") else "n/a"
            floor = f"{r['floor_ms']:.1f}" if "floor_ms" in r else "–"
            vs_floor = f"{r['time_vs_floor']:.2f}" if "time_vs_floor" in r else "–"
            front = ", ".join(w for w in ("kept", "peak") if mode in fronts[w])
            mb = r.get("max_batch")
            lines.append(
                f"| {net_name} | {mode} | {fmt_bytes(r['kept_for_backward'])}"
                f" | {fmt_bytes(r['peak_above_before_forward'])}"
                f" | {r['step_ms']:.2f} | {ratio} | {floor} | {vs_floor} | {front}"
                f" | {r['grad_rel_err']:.1e} | {mb if mb is not None else 'n/a'} |")
    lines += _targets(results)
    lines += ["", "The write-up's four readings (tensor bytes alive; kept for bwd = after loss − "
              "before fwd − the loss):", "",
              "| network | mode | before fwd | after fwd | after loss | after bwd "
              "| activations after fwd |", "|---|---|---:|---:|---:|---:|---:|"]
    for net_name, modes in results["networks"].items():
        for mode, r in modes.items():
            if "readings" not in r:
                continue
            rd = r["readings"]
            lines.append(f"| {net_name} | {mode} | "
                         + " | ".join(fmt_bytes(rd[k]) for k in READINGS)
                         + f" | {fmt_bytes(r['activations_after_forward'])} |")
    return "\n".join(lines) + "\n"
