"""The benchmark: the CLI on the tiny preset (--full: every network, every default mode), the
figures it must give exactly, timing on the stock allocator, and compile modes that must not fail
silently.

The CLI test compiles with the aot_eager backend (Dynamo + AOTAutograd, the partitioner included,
no C++ code generation: inductor on 2 CPU cores would take minutes); one test runs inductor on the
fused chain, the case where a partitioner could re-decide what the fused op keeps.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from ckpt_ext import _C
from ckpt_ext.bench import cli, headline, measure, orchestrate, presets, report
from ckpt_ext.models import NETWORKS, is_pinn, recomputed_gemms

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RNG = torch.get_rng_state().nbytes  # what a checkpoint call keeps besides its input
DOUBLE_BACKWARD = "torch.compile with aot_autograd does not currently support double backward"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt_ext.bench", "--device", "cpu", "--preset", "tiny",
         "--steps", "2", "--compile-backend", "aot_eager", "--threads", "1", "--out", str(out),
         "--budget", "4MiB", "--full"],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stem = out / "cpu-tiny"
    return proc, stem, json.loads(stem.with_suffix(".json").read_text())


def test_cli_writes_table_json_png(tiny_run):
    proc, stem, res = tiny_run
    assert "Benchmark conditions: cpu" in proc.stdout
    assert "bench:" in proc.stderr  # the progress bar
    table = stem.with_suffix(".md").read_text()
    main = table.split("\n\n")[1]  # the first table, after the conditions
    rows = [line for line in main.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + sum(presets.runs_mode(n, m) for n in NETWORKS
                                for m in presets.DEFAULT_MODES)
    assert "| llama-mlp | liger |" in main and "| chain | liger |" not in main
    assert "--compile-backend aot_eager" in table  # the command is part of the conditions
    assert res["conditions"]["budget_bytes"] == 4 << 20
    png = stem.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_cli_no_mode_fails_but_compile_of_double_backward(tiny_run):
    # A compile mode that errors is a failure here, not an n/a to shrug at; the one expected error
    # is torch.compile refusing the physics-informed double backward, reported with its message.
    proc, stem, res = tiny_run
    assert list(res["networks"]) == list(NETWORKS)
    for name, modes in res["networks"].items():
        assert list(modes) == [m for m in presets.DEFAULT_MODES if presets.runs_mode(name, m)]
        assert ("liger" in modes) == (name in ("llama-mlp", "llama-lora",
                                               "llama-lora-dropout")), name
        for mode, r in modes.items():
            if is_pinn(name) and presets.MODES[mode].compiled:
                assert r == {"error": f"RuntimeError: {DOUBLE_BACKWARD}"}, mode
                assert f"{name}/{mode}: RuntimeError: {DOUBLE_BACKWARD}" in proc.stderr
            elif mode == "checkpoint-stack" and name != "chain":
                assert r["same_as"] == "checkpoint", name
            else:
                assert "error" not in r, (name, mode, r.get("error"))
    table = stem.with_suffix(".md").read_text()
    assert f"| pinn | compile | n/a (RuntimeError: {DOUBLE_BACKWARD}) |" in table
    assert "| residual | checkpoint-stack | = checkpoint (every block is already checkpointed) |" \
        in table


def test_cli_exact_memory_figures(tiny_run):
    _, _, res = tiny_run
    s = presets.PRESETS["tiny"]
    unit = s["batch"] * s["hidden"] * 4  # one (batch, hidden) float32 activation
    D = s["depth"]
    nets = res["networks"]
    chain = nets["chain"]
    # the fused stack keeps its input, one activation; so does checkpointing the whole stack (plus
    # the RNG state it saves); the write-up's placement and plain keep linear1's output and every
    # block's output
    assert chain["fused"]["kept_for_backward"] == unit
    assert chain["checkpoint-stack"]["kept_for_backward"] == unit + RNG
    assert chain["plain"]["kept_for_backward"] == (D + 1) * unit
    assert chain["checkpoint"]["kept_for_backward"] == (D + 1) * unit + (D - 1) * RNG
    assert unit <= chain["compile-checkpoint"]["kept_for_backward"] <= unit + RNG
    for name in ("residual", "mlp"):
        assert nets[name]["fused"]["kept_for_backward"] == D * unit, name
        assert nets[name]["checkpoint"]["kept_for_backward"] == D * (unit + RNG), name
        assert nets[name]["plain"]["kept_for_backward"] == \
            D * {"residual": 2, "mlp": 5}[name] * unit, name
    # bert-mlp: every mode keeps LayerNorm's input and statistics per block and each block's input
    # (the first block's is x, not counted); plain also the (tokens, 3072) GELU input and output
    b = presets.PRESETS["tiny"]["bert"]
    bert, bert_unit = nets["bert-mlp"], b["batch"] * 768 * 4
    common = b["depth"] * (bert_unit + 2 * b["batch"] * 4) + (b["depth"] - 1) * bert_unit
    assert bert["fused"]["kept_for_backward"] == common
    assert bert["checkpoint"]["kept_for_backward"] == common + b["depth"] * RNG
    assert bert["plain"]["kept_for_backward"] == common + b["depth"] * 2 * 4 * bert_unit
    # 16 tokens: the weight gradients make the peak; FusedMLP(gelu)'s C++ node frees its
    # incoming (tokens, 768) gradient after the top layer's pass (measured below checkpoint with
    # torch 2.14; at most one such buffer above it on every supported torch)
    assert bert["fused"]["peak_above_before_forward"] <= \
        bert["checkpoint"]["peak_above_before_forward"] + bert_unit
    for name in ("pinn-sin", "pinn-silu"):
        for what in ("kept_for_backward", "peak_above_before_forward"):
            assert nets[name]["fused"][what] <= nets[name]["plain"][what], (name, what)
    for name in ("chain", "residual", "mlp", "bert-mlp"):
        fused, compiled = nets[name]["fused"], nets[name]["compile-fused"]
        # compiling the fused model must not make it keep more (a partitioner re-deciding what
        # to save) nor peak higher, but for two buffers: the compiled region's backward node is
        # AOTAutograd's Python autograd.Function, which holds the incoming (batch, hidden)
        # gradient and its saved input to its end, while eager's C++ node
        # (csrc/autograd_node.cpp) frees the gradient after the top layer's elementwise pass and,
        # without retain_graph, the input before it allocates grad_x (measured with torch 2.11:
        # residual 7,936 B above fused, 2 units less 256 B)
        assert compiled["kept_for_backward"] == fused["kept_for_backward"], name
        two = 2 * (bert_unit if name == "bert-mlp" else unit)
        assert compiled["peak_above_before_forward"] <= fused["peak_above_before_forward"] + two, \
            name
    # llama-lora: every mode keeps each MLP's input and, from the second block on, the frozen
    # norm's input and (tokens, 1) rsqrt; Unsloth's policy the gate's and up's outputs besides;
    # checkpoint an RNG state and peft's three 8-byte scaling scalars per block
    # (tests/bench/test_models.py has every mode's figure)
    lm = presets.PRESETS["tiny"]["llama"]
    T, W, I, D = lm["batch"], lm["in_features"], lm["hidden"], lm["depth"]
    common = D * T * W * 4 + (D - 1) * (T * W * 4 + T * 4)
    lora, lora_drop = nets["llama-lora"], nets["llama-lora-dropout"]
    assert lora["fused"]["kept_for_backward"] == common
    assert lora["unsloth"]["kept_for_backward"] == common + D * 2 * T * I * 4
    assert lora["checkpoint"]["kept_for_backward"] == common + D * (RNG + 3 * 8)
    assert lora_drop["fused"]["kept_for_backward"] == common + D * RNG
    assert lora_drop["unsloth"] == {"same_as": "plain",
                                    "why": "Unsloth runs peft's forward at lora_dropout > 0"}
    # moe: fused keeps what checkpoint keeps but its RNG states, and the routing
    m = presets.PRESETS["tiny"]["moe"]
    moe = nets["moe"]
    assert moe["fused"]["kept_for_backward"] == moe["checkpoint"]["kept_for_backward"] \
        - m["depth"] * RNG + NETWORKS["moe"].routing_bytes(m["batch"], m["depth"])
    for name, modes in nets.items():
        for mode, r in modes.items():
            if "readings" not in r:
                continue
            assert set(presets.READINGS) == set(r["readings"])
            assert r["kept_for_backward"] == (r["readings"]["after loss"]
                                              - r["readings"]["before forward"] - 4)
            tl = r["timeline"]
            assert len(tl["t_ms"]) == len(tl["bytes_above_before_forward"]) > 4
            assert max(tl["bytes_above_before_forward"]) == r["peak_above_before_forward"]


def test_cli_times_floors_and_gradients(tiny_run):
    _, _, res = tiny_run
    c = res["conditions"]
    for name, modes in res["networks"].items():
        sz = presets.sizes_in(c, name)
        for mode, r in modes.items():
            if "step_ms" not in r:
                continue
            # eager modes are timed in plain's loop, compiled ones in a loop of their own with
            # plain again; each ratio is to plain in the same loop
            plain_ms = r["plain_ms_same_loop"]
            if not presets.MODES[mode].compiled:
                assert plain_ms == modes["plain"]["step_ms"], mode
            assert len(r["step_ms_all"]) == 2 and r["step_ms"] > 0
            assert r["time_vs_plain"] == pytest.approx(r["step_ms"] / plain_ms)
            assert r["grad_rel_err"] < 1e-5, (name, mode)
            assert r["max_batch"] is None or r["max_batch"] >= 0
            gemms = recomputed_gemms(name, presets.model_mode(name, mode), sz["batch"],
                                     sz["in_features"], sz["hidden"], sz["depth"])
            if gemms:  # a recomputing mode: floor = plain + its GEMMs timed alone
                assert r["recomputed_gemms"] == [list(g) for g in gemms]
                assert len(r["recompute_ms_all"]) == 2
                assert r["floor_ms"] == pytest.approx(plain_ms + r["recompute_ms"])
                assert r["time_vs_floor"] == pytest.approx(r["step_ms"] / r["floor_ms"])
            else:
                assert "floor_ms" not in r, (name, mode)


def test_cli_targets(tiny_run):
    # Each network with targets has them in the JSON and the table, computed from its own rows.
    _, stem, res = tiny_run
    assert set(res["targets"]) == {"llama-lora", "llama-lora-dropout", "moe"}
    table = stem.with_suffix(".md").read_text()
    for name, met in res["targets"].items():
        assert f"Targets, {name} (fused; same run):" in table
        modes = res["networks"][name]
        assert met["max batch >= 2x plain's"]["ratio"] == pytest.approx(
            modes["fused"]["max_batch"] / modes["plain"]["max_batch"])
        assert met["step <= 1.05x the floor"]["ratio"] == modes["fused"]["time_vs_floor"]
        for what, t in met.items():
            assert t["met"] in (True, False), (name, what)
            word = "**met**" if t["met"] else "**missed**"
            assert f"- {what}: {word} (" in table
    # fused keeps no more than the blocks' inputs: met at every size
    assert res["targets"]["moe"]["kept <= the blocks' inputs and the routing"]["met"]
    for name in ("llama-lora", "llama-lora-dropout"):
        assert res["targets"][name]["kept beyond the blocks' inputs <= 10 % of plain's"]["met"]
    assert res["targets"]["llama-lora"]["max batch >= 1.5x the unsloth mode's"][
        "unsloth_max_batch"] == res["networks"]["llama-lora"]["unsloth"]["max_batch"]
    assert res["targets"]["llama-lora-dropout"]["max batch >= 1.5x the unsloth mode's"][
        "against"].startswith("plain: Unsloth runs peft's forward")
    # fused beside Unsloth's policy (plain's with dropout) and checkpoint, from their own rows
    for name, other in (("llama-lora", "unsloth"), ("llama-lora-dropout", "plain")):
        side = res["targets"][name]["kept <= the unsloth mode's and checkpoint's"]
        modes = res["networks"][name]
        for m in ("fused", other, "checkpoint"):
            assert side[f"{m}_bytes"] == modes[m]["kept_for_backward"], (name, m)
            assert side[f"{m}_ms"] == modes[m]["step_ms"], (name, m)
        assert side[f"step_ratio_to_{other}"] == pytest.approx(
            modes["fused"]["step_ms"] / modes[other]["step_ms"])
        assert side["met"] == (modes["fused"]["kept_for_backward"] <= min(
            modes[other]["kept_for_backward"], modes["checkpoint"]["kept_for_backward"]))
    assert res["targets"]["llama-lora"]["kept <= the unsloth mode's and checkpoint's"]["met"]


def test_network_without_its_requirements_says_so(monkeypatch, tmp_path):
    real = orchestrate.importlib.util.find_spec
    monkeypatch.setattr(orchestrate.importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    cfg = cli.config_from_args(["--device", "cpu", "--preset", "tiny", "--networks", "moe",
                                "--modes", "plain,fused", "--steps", "1", "--warmup", "0",
                                "--out", str(tmp_path), "--no-progress"])
    res = orchestrate.run(cfg)
    assert res["networks"]["moe"] == {m: {"error": "needs transformers, which is not installed"}
                                      for m in ("plain", "fused")}
    assert res["targets"] == {}
    assert "| moe | fused | n/a (needs transformers, which is not installed) |" in \
        report.markdown(res)


def test_timed_steps_run_on_the_stock_allocator(monkeypatch, tmp_path):
    seen = {"timed": [], "measured": []}
    real_timed, real_measured = orchestrate.timed_step, orchestrate.measured_step

    def timed(*args, **kwargs):
        seen["timed"].append(_C.cpu_meter_installed())
        return real_timed(*args, **kwargs)

    def measured(*args, **kwargs):
        seen["measured"].append(_C.cpu_meter_installed())
        return real_measured(*args, **kwargs)

    monkeypatch.setattr(orchestrate, "timed_step", timed)
    monkeypatch.setattr(orchestrate, "measured_step", measured)
    installed_before = _C.cpu_meter_installed()
    cfg = cli.config_from_args(["--device", "cpu", "--preset", "tiny", "--networks", "chain",
                                  "--modes", "plain,fused", "--steps", "2", "--warmup", "1",
                                  "--out", str(tmp_path), "--no-progress"])
    res = orchestrate.run(cfg)["networks"]["chain"]
    assert seen["timed"] and not any(seen["timed"])  # warm-up and timed steps: uninstalled
    assert seen["measured"] and all(seen["measured"])  # memory steps: counted
    assert _C.cpu_meter_installed() == installed_before
    assert res["fused"]["kept_for_backward"] == 16 * 64 * 4


def test_inductor_compiled_fused_keeps_what_eager_fused_keeps(tmp_path):
    cfg = cli.config_from_args(["--device", "cpu", "--preset", "tiny", "--networks", "chain",
                                  "--modes", "plain,fused,compile-fused", "--steps", "1",
                                  "--warmup", "1", "--out", str(tmp_path), "--no-progress"])
    assert cfg.compile_backend == "inductor"
    res = orchestrate.run(cfg)["networks"]["chain"]
    fused, compiled = res["fused"], res["compile-fused"]
    assert "error" not in compiled, compiled.get("error")
    assert compiled["kept_for_backward"] == fused["kept_for_backward"] == 16 * 64 * 4
    # at most the incoming (batch, hidden) gradient above: AOTAutograd's backward node (a Python
    # autograd.Function) holds it to its end, eager's C++ node frees it after the top layer
    assert compiled["peak_above_before_forward"] <= fused["peak_above_before_forward"] + 16 * 64 * 4
    assert compiled["grad_rel_err"] < 1e-5


def test_pareto_front():
    pts = {"plain": (1.0, 8.0), "ckpt": (1.2, 2.0), "fused": (1.1, 2.0), "slow": (2.0, 9.0),
           "tie": (1.1, 2.0), "lean": (3.0, 1.0)}
    # fused and tie are the same point: neither beats the other, both are on the front
    assert report.pareto_front(pts) == ["plain", "fused", "tie", "lean"]


def test_markdown_rows_for_errors_and_same_as():
    cfg = cli.config_from_args(["--device", "cpu", "--preset", "tiny"])
    text = report.markdown({"conditions": orchestrate.conditions(cfg), "networks": {"mlp": {
        "compile": {"error": "RuntimeError: boom"},
        "checkpoint-stack": {"same_as": "checkpoint", "why": "every block is already checkpointed"},
    }}})
    assert "| mlp | compile | n/a (RuntimeError: boom) |" in text
    assert "| mlp | checkpoint-stack | = checkpoint (every block is already checkpointed) |" in text


def test_presets_and_defaults():
    small = presets.PRESETS["small"]
    assert (small["batch"], small["hidden"], small["depth"]) == (2048, 64, 4)
    for name, p in presets.PRESETS.items():
        assert p["steps"] >= 15 or name == "tiny", name
    cfg = cli.config_from_args(["--device", "cpu"])
    assert cfg.preset == "cpu-default" and cfg.out == "bench_out"  # untracked (.gitignore)
    # without --full: the README's figures (headline.block reads exactly these modes)
    assert cfg.modes == ["plain", "checkpoint", "checkpoint-stack", "fused", "compile-checkpoint"]
    assert cfg.networks == ["chain", "residual", "mlp", "pinn", "pinn-sin", "pinn-silu"]
    assert cfg.section == "main"
    cfg = cli.config_from_args(["--device", "cpu", "--full"])
    assert cfg.modes == presets.DEFAULT_MODES and "checkpoint-reentrant" not in cfg.modes
    assert cfg.networks == ["chain", "residual", "mlp", "bert-mlp", "llama-mlp", "llama-lora",
                            "llama-lora-dropout", "moe", "pinn", "pinn-sin", "pinn-silu"]
    assert (cfg.llama.batch, cfg.llama.in_features, cfg.llama.hidden, cfg.llama.depth) == \
        (2048, 1024, 2816, 3)
    assert cfg.budget_of("llama-mlp") == cfg.llama_budget == 1 << 30
    assert cfg.budget_of("llama-lora-dropout") == cfg.llama_budget
    assert cfg.sizes_of("llama-lora") == cfg.llama
    assert (cfg.moe.batch, cfg.moe.in_features, cfg.moe.hidden, cfg.moe.depth) == \
        (2048, 1024, 1024, 3)
    assert cfg.budget_of("moe") == cfg.moe_budget == 2 << 30
    assert (cfg.pinn.batch, cfg.pinn.in_features, cfg.pinn.hidden, cfg.pinn.depth) == \
        (4096, 2, 64, 4)
    assert (cfg.bert.batch, cfg.bert.in_features, cfg.bert.hidden, cfg.bert.depth) == \
        (2048, 768, 3072, 3)
    assert cfg.budget_of("pinn-sin") == cfg.budget == 512 << 20
    assert cfg.budget_of("bert-mlp") == cfg.bert_budget == 1 << 30
    for name in NETWORKS:  # a network without checkpoint-stack shows it as checkpoint's row
        assert (("checkpoint-stack" in NETWORKS[name].MODES)
                != ((name, "checkpoint-stack") in presets.SAME_AS)), name
    cfg = cli.config_from_args(["--device", "cpu", "--bert-tokens", "64", "--bert-depth", "1",
                                "--budget", "1MiB"])
    assert (cfg.bert.batch, cfg.bert.depth, cfg.bert_budget, cfg.budget) == \
        (64, 1, 1 << 20, 1 << 20)
    cfg = cli.config_from_args(["--device", "cpu", "--llama-tokens", "64", "--llama-depth", "1",
                                "--moe-tokens", "32", "--moe-depth", "2"])
    assert (cfg.llama.batch, cfg.llama.depth, cfg.llama_budget) == (64, 1, 1 << 30)
    assert (cfg.moe.batch, cfg.moe.depth) == (32, 2)
    cfg = cli.config_from_args(["--device", "cpu", "--networks", "llama-lora,moe"])
    assert cfg.networks == ["llama-lora", "moe"]
    cfg = cli.config_from_args(["--device", "cpu", "--preset", "small", "--hidden", "32",
                                  "--pinn-points", "512", "--steps", "20"])
    assert (cfg.sizes.batch, cfg.sizes.hidden, cfg.pinn.batch, cfg.pinn.hidden, cfg.steps) == \
        (2048, 32, 512, 64, 20)
    with open(os.path.join(ROOT, ".gitignore")) as f:
        assert "bench_out/" in f.read().split()


def test_parse_bytes_and_max_batch():
    assert presets.parse_bytes("512MiB") == 512 << 20
    assert presets.parse_bytes("1.5GB") == 1_500_000_000
    assert presets.parse_bytes("4096") == 4096
    with pytest.raises(Exception, match="budget must look like"):
        presets.parse_bytes("lots")
    # peak = 100 + 10 * batch: at batch 16 -> 260, at 8 -> 180; budget 1000 -> 90 samples
    assert measure.max_batch(1000, 16, 260, 180, 8) == {"per_sample_bytes": 10.0,
                                                      "fixed_bytes": 100.0, "max_batch": 90}


def test_cli_rejects_bad_names():
    with pytest.raises(SystemExit):
        cli.config_from_args(["--device", "cpu", "--modes", "plain,turbo"])
    with pytest.raises(SystemExit):
        cli.config_from_args(["--device", "cpu", "--networks", "transformer"])
    with pytest.raises(SystemExit):
        cli.config_from_args(["--device", "cpu", "--pinn-depth", "0"])
    with pytest.raises(SystemExit):
        cli.config_from_args(["--device", "cpu", "--bert-tokens", "1"])


_IMPORT_CHECK = r"""
import sys
import torch  # torch itself imports tqdm (torch.hub) and pynvml (torch.cuda) where installed
before = set(sys.modules)
import ckpt_ext
new = sorted(m for m in set(sys.modules) - before
             if m.split(".")[0] in ("matplotlib", "tqdm", "pynvml") or m.startswith("ckpt_ext.bench"))
print("NEW", new)
"""


def test_import_ckpt_ext_leaves_the_benchmark_and_its_tools_out():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _IMPORT_CHECK], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NEW []" in proc.stdout, proc.stdout
    # and without them installed at all, the library still imports
    blocked = ("import sys\nfor m in ('matplotlib', 'tqdm', 'pynvml'): sys.modules[m] = None\n"
               "import ckpt_ext\nassert 'ckpt_ext.bench' not in sys.modules\nprint('OK')")
    proc = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_readme_figures_are_the_committed_results():
    """The README's status block is generated from bench/results/*.json, never typed."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert headline.replace(text, headline.block(headline.load(ROOT))) == text, \
        "run: python -m ckpt_ext.bench.headline --write README.md"
    for rel in headline.RESULTS:  # the block's source files are the committed runs' own tables
        assert os.path.exists(os.path.join(ROOT, rel.replace(".json", ".md"))), rel


def test_headline_block_figures():
    res = {"conditions": {"preset": "p", "device": "cpu", "dtype": "float32", "torch": "t",
                          "command": "c"},
           "networks": {"chain": {
               "plain": {"kept_for_backward": 8 << 20, "peak_above_before_forward": 12 << 20,
                         "time_vs_plain": 1.0, "max_batch": 1000},
               "checkpoint-stack": {"time_vs_plain": 1.5},
               "compile-checkpoint": {"time_vs_plain": 1.2},
               "fused": {"kept_for_backward": 2 << 20, "peak_above_before_forward": 6 << 20,
                         "time_vs_plain": 1.2, "max_batch": 2000}}}}
    row = headline.block([res]).splitlines()[2]
    assert row == ("| p | chain | 2.00 MiB vs 8.00 MiB (25 %) | 6.00 MiB vs 12.00 MiB (50 %) "
                   "| 0.80× | 1.00× | 2,000 vs 1,000 |")
    with pytest.raises(ValueError, match="headline:begin"):
        headline.replace("no markers here", "x")
