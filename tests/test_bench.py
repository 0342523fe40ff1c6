"""The benchmark CLI: runs on the tiny preset and writes its table, JSON and PNG."""
import json
import os
import subprocess
import sys

import pytest

from ckpt_ext import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cli_tiny_writes_table_json_png(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    modes = "plain,checkpoint,checkpoint-reentrant,fused"
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt_ext.bench", "--device", "cpu", "--preset", "tiny",
         "--modes", modes, "--steps", "2", "--out", str(tmp_path), "--budget", "4MiB"],
        capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Benchmark conditions: cpu" in proc.stdout
    assert "bench:" in proc.stderr  # the progress bar
    stem = tmp_path / "cpu-tiny"
    table = (stem.with_suffix(".md")).read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 3 * 4  # header + networks x modes
    assert "n/a" not in table
    res = json.loads(stem.with_suffix(".json").read_text())
    assert res["conditions"]["budget_bytes"] == 4 << 20
    sizes = bench.PRESETS["tiny"]
    unit = sizes["batch"] * sizes["hidden"] * 4
    for name, modes_res in res["networks"].items():
        assert list(modes_res) == modes.split(",")
        fused, plain = modes_res["fused"], modes_res["plain"]
        assert fused["kept_for_backward"] == sizes["depth"] * unit
        assert plain["kept_for_backward"] > fused["kept_for_backward"]
        for mode, r in modes_res.items():
            assert set(bench.READINGS) == set(r["readings"])
            assert r["grad_rel_err"] < 1e-5, (name, mode)
            assert len(r["step_ms_all"]) == 2 and r["step_ms"] > 0
            assert r["max_batch"] is None or r["max_batch"] >= 0
            tl = r["timeline"]
            assert len(tl["t_ms"]) == len(tl["bytes_above_before_forward"]) > 4
            assert max(tl["bytes_above_before_forward"]) == r["peak_above_before_forward"]
    png = stem.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_compile_mode_gives_figures_or_a_reason(tmp_path):
    cfg = bench.config_from_args(["--device", "cpu", "--preset", "tiny", "--networks", "chain",
                                  "--modes", "plain,compile", "--steps", "1", "--warmup", "1",
                                  "--out", str(tmp_path), "--no-progress"])
    res = bench.run(cfg)["networks"]["chain"]["compile"]
    if "error" in res:  # e.g. no C++ compiler: reported, not raised
        assert res["error"]
        assert "n/a (" in bench.markdown({"conditions": bench.conditions(cfg),
                                          "networks": {"chain": {"compile": res}}})
    else:
        assert res["grad_rel_err"] < 1e-5
        assert res["kept_for_backward"] > 0


def test_parse_bytes_and_max_batch():
    assert bench.parse_bytes("512MiB") == 512 << 20
    assert bench.parse_bytes("1.5GB") == 1_500_000_000
    assert bench.parse_bytes("4096") == 4096
    with pytest.raises(Exception, match="budget must look like"):
        bench.parse_bytes("lots")
    cfg = bench.config_from_args(["--device", "cpu", "--preset", "tiny", "--budget", "1000"])
    # peak = 100 + 10 * batch: at batch 16 -> 260, at 8 -> 180; budget 1000 -> 90 samples
    assert bench.max_batch(cfg, 260, 180, 8) == {"per_sample_bytes": 10.0, "fixed_bytes": 100.0,
                                                 "max_batch": 90}


def test_cli_rejects_bad_names():
    with pytest.raises(SystemExit):
        bench.config_from_args(["--device", "cpu", "--modes", "plain,turbo"])
    with pytest.raises(SystemExit):
        bench.config_from_args(["--device", "cpu", "--networks", "transformer"])
