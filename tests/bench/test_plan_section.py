"""The benchmark's ``plan`` section on a small Llama (CPU): every configuration measured once, the
rows per budget pick what fits, the targets are computed from the figures, the table, JSON and
plot are written; the compiled configuration's FLOPs are counted on its partitioned graphs."""
from __future__ import annotations

import json

import pytest
import torch

from ckpt_ext.bench import plan_plot, plan_report, plan_section

pytest.importorskip("transformers")

SIZES = dict(layers=4, steps=1, warmup=0)


@pytest.fixture(scope="module")
def section():
    s = plan_section.Section(torch.device("cpu"), torch.float32, "tiny",
                             methods=("plan", "hf-every-layer", "hf-every-n"),
                             log=lambda msg: None, sizes=SIZES)
    res = s.run()
    res["conditions"] = dict(device="cpu", dtype="float32", torch=torch.__version__,
                             transformers="x", compile_backend="inductor",
                             memory_meter="exact bytes", command="test")
    return res


def test_rows_pick_what_fits_and_the_plan_fits(section):
    c = section["configs"]
    assert len(section["rows"]) == len(plan_section.BUDGET_POSITIONS)
    assert section["budgets"] == sorted(section["budgets"], reverse=True)
    last_flops = -1
    for row in section["rows"]:
        b, mine = row["budget"], c[row["plan"]]
        assert mine["peak"] <= b
        assert abs(mine["peak"] - mine["predicted_peak"]) <= 0.05 * mine["predicted_peak"]
        assert mine["added_flops"] >= last_flops
        last_flops = mine["added_flops"]
        n = row["hf-every-n"]
        if n is not None:  # the largest n that fits: the least recompute of its kind
            assert c[n]["peak"] <= b
            assert all(c[f"hf every {k}"]["peak"] > b
                       for k in range(c[n]["every_n"] + 1, SIZES["layers"] + 1))
    assert c["hf every 1"]["added_flops"] > 0 and c["plain"]["added_flops"] == 0
    # plain's peak: nothing to recompute (the layers' letters, then the head's)
    assert section["rows"][0]["plan"] == "plan n,n,n,n,n"
    t = section["targets"]["measured peak never above the budget"]
    assert t["met"] is True and t["per_budget"] == [True] * len(section["rows"])


def test_table_json_and_plot(section, tmp_path):
    text = plan_report.markdown(section)
    assert text.count("| ckpt_ext.plan |") == len(section["rows"])
    assert "Targets:" in text and "transformers, every layer" in text
    json.dumps(section)  # every figure is plain JSON
    assert plan_plot.plot(section, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compiled_flops_counted_on_the_partition():
    """activation_memory_budget 0 recomputes more than 1: the counted FLOPs say so."""
    from ckpt_ext.planner.compiled import compiled_flops

    model = plan_section.llama(dict(plan_section.PLAN_SIZES["tiny"], layers=1),
                               torch.device("cpu"), torch.float32)
    inputs = plan_section.inputs_of(plan_section.PLAN_SIZES["tiny"], torch.device("cpu"))
    eager = plan_section._flops(model, inputs)
    counted = {f: compiled_flops(model, lambda m: plan_section._step(m, inputs), f)
               for f in (1.0, 0.0)}
    assert counted[1.0] == eager < counted[0.0]
