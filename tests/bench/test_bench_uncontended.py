"""scripts/bench_uncontended.py, the reading of a results file's step times in their uncontended
steps that docs/benchmark.md quotes: which steps it keeps, and its table from a results file."""
import json
import os
import runpy

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "bench_uncontended.py")


@pytest.fixture(scope="module")
def script():
    if not os.path.exists(SCRIPT):
        pytest.skip("scripts/ is not beside these tests")
    return runpy.run_path(SCRIPT, run_name="bench_uncontended_under_test")


def test_keeps_the_steps_near_the_fastest(script):
    assert script["uncontended"]([10.0, 31.0, 11.0, 15.0, 16.0, 40.0], 1.5) == (11.0, 3)
    assert script["uncontended"]([5.0], 1.5) == (5.0, 1)


def test_table_from_a_results_file(script, tmp_path, capsys):
    # plain's uncontended median 100, checkpoint's 150, fused's 120 over a floor of 100 + 10
    rows = {"plain": {"step_ms": 200.0, "step_ms_all": [100.0, 300.0, 100.0]},
            "checkpoint": {"step_ms": 150.0, "step_ms_all": [150.0, 150.0, 400.0],
                           "recompute_ms_all": [20.0, 20.0]},
            "fused": {"step_ms": 300.0, "step_ms_all": [120.0, 320.0, 330.0],
                      "recompute_ms_all": [10.0, 50.0]},
            "unsloth": {"same_as": "plain", "why": "..."}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"networks": {"net": rows}}))
    script["main"]([str(path)])
    out = capsys.readouterr().out
    assert "| plain | 200 | 100 | 100 (2) | 1.00 | 0.67 | – | – |" in out
    assert "| checkpoint | 150 | 150 | 150 (2) | 1.50 | 1.00 | 120 | 1.25 |" in out
    assert "| fused | 300 | 120 | 120 (1) | 1.20 | 0.80 | 110 | 1.09 |" in out
    assert "unsloth" not in out
