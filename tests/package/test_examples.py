"""examples/: each example runs at tiny sizes and prints what its docs page shows
(examples/trl_lora.py: the table of docs/trainers.md, with its four ways and the callback's
units fused at every call)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")


def _example(name):
    path = os.path.join(EXAMPLES, name)
    if not os.path.exists(path):
        pytest.skip("examples/ is not beside these tests (tests copied out of the source tree)")
    return path


def _rows(out: str) -> dict:
    """The markdown table's rows by way ("(a)", ...): the cells after the way's name."""
    rows = {}
    for line in out.splitlines():
        m = re.match(r"\| (\([a-d]\)) [^|]*\|(.*)\|$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def test_trl_lora_runs():
    for lib in ("trl", "peft", "datasets", "tokenizers"):
        pytest.importorskip(lib)
    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, _example("trl_lora.py"), "--steps", "2", "--seq", "32",
                           "--hidden", "128", "--inter", "352", "--layers", "2", "--rounds", "0"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _rows(proc.stdout)
    assert sorted(rows) == ["(a)", "(b)", "(c)", "(d)"], proc.stdout
    # cells: checkpointing, peak, time, vs plain, loss, fused / unfused calls, predicted peak
    assert [rows[w][0] for w in "(a) (b) (c) (d)".split()] == ["on", "off", "off", "off"]
    fused, unfused = (int(n) for n in rows["(b)"][5].split(" / "))
    assert fused == 2 * 2 and unfused == 0, rows["(b)"]  # 2 layers' MLPs, 2 steps
    assert rows["(c)"][6].endswith("MiB"), rows["(c)"]  # the plan's predicted peak
    assert "FallbackWarning" not in proc.stderr, proc.stderr[-4000:]
