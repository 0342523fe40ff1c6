"""scripts/gpu_check.sh without a GPU: its plan fits the loan and is the one docs/gpu_check.md
justifies; the tests step's order by value (scripts/gpu_check_pytest.py) runs every family in every
dtype before the long sweeps; the sanitizer case and the kernel bench cover every activation of
the registry."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

import ckpt_ext

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts")
LOAN_S = 470  # 15 minutes less machine start, transfers and a rerun's margin (docs/gpu_check.md)


def _script(name):
    path = os.path.join(SCRIPTS, name)
    if not os.path.exists(path):
        pytest.skip("scripts/ is not beside these tests (tests copied out of the source tree)")
    spec = importlib.util.spec_from_file_location(name[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _plan():
    if not os.path.exists(os.path.join(SCRIPTS, "gpu_check.sh")):
        pytest.skip("scripts/ is not beside these tests")
    out = subprocess.run(["bash", os.path.join(SCRIPTS, "gpu_check.sh"), "--plan"],
                         capture_output=True, text=True, check=True).stdout
    caps = {}
    for line in out.splitlines():
        m = re.match(r"(\w+)\s+(\d+)\s+(\d+|-)\s", line)
        if m:
            caps[m.group(1)] = int(m.group(2))
    total = int(re.search(r"total cap: (\d+) s", out).group(1))
    return caps, total


def test_plan_fits_the_loan_and_sums_to_its_total():
    caps, total = _plan()
    assert {"probe", "build", "import", "tests", "memcheck", "kernel_bench", "summary"} <= set(caps)
    assert sum(caps.values()) == total <= LOAN_S, caps


def test_every_cap_is_the_one_the_doc_justifies():
    caps, total = _plan()
    doc = open(os.path.join(ROOT, "docs", "gpu_check.md"), encoding="utf-8").read()
    for step, cap in caps.items():
        m = re.search(rf"^\| [\w–-]+ \| {step} \| (\d+)", doc, re.M)
        assert m and int(m.group(1)) == cap, f"{step}: {cap} s in the plan, the doc's table says " \
                                             f"{m.group(1) if m else 'nothing'}"
    assert f"{total} s" in doc


def test_value_order_covers_every_family_and_dtype_before_the_sweeps():
    order_mod = _script("gpu_check_pytest.py")
    dtypes, acts = ["f32", "f64", "bf16", "f16"], [f"a{i}" for i in range(8)]
    cases = [(f"tests/ops/test_ops.py::test_sweep[{d}-{n}]", {"dtype": d, "n": n})
             for d in dtypes for n in range(1, 34)]
    cases += [(f"tests/ops/test_mlp.py::test_acts[{a}-{d}-{w}]", {"act": a, "dtype": d, "w": w})
              for a in acts for d in dtypes for w in (1, 8)]
    cases += [("tests/ops/test_ops_cuda.py::test_plain", {})]
    order, n_cover = order_mod.value_order(cases, first=["tests/ops/test_ops_cuda.py"])
    assert sorted(order) == list(range(len(cases)))  # each case once
    cover = [cases[i] for i in order[:n_cover]]
    assert cover[0][0].endswith("test_plain")  # the files named first run first
    assert {p["dtype"] for i, p in cover if "test_sweep" in i} == set(dtypes)
    # every activation and width in every dtype, not every combination of the three
    assert {(p["act"], p["dtype"]) for i, p in cover if "test_acts" in i} == \
        {(a, d) for a in acts for d in dtypes}
    assert {(p["w"], p["dtype"]) for i, p in cover if "test_acts" in i} == \
        {(w, d) for w in (1, 8) for d in dtypes}
    assert sum("test_acts" in i for i, _ in cover) < len(acts) * len(dtypes) * 2
    # the 33-value width range is a sweep: not covered value by value, and run last
    assert sum("test_sweep" in i for i, _ in cover) == len(dtypes)
    # then the rest, the function with fewer cases left first
    rest = [cases[i][0] for i in order[n_cover:]]
    n_acts_left = sum("test_acts" in i for i, _ in cases) - sum("test_acts" in i for i, _ in cover)
    assert all("test_acts" in i for i in rest[:n_acts_left])
    assert all("test_sweep" in i for i in rest[n_acts_left:])


def test_sanitizer_case_and_kernel_bench_cover_every_activation():
    case = _script("gpu_sanitize_case.py")
    names = [name for name, _, _ in case.cases()]
    assert len(names) == len(set(names))
    for dtype in case.DTYPES:
        assert f"activations {dtype}" in names
    bench = _script("gpu_kernel_bench.py")
    out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_kernel_bench.py"), "--list",
                          "--act-log2-sizes", "24"], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr
    assert f"activations: {', '.join(ckpt_ext.ACTIVATIONS)}" in out.stdout
    kinds = [k for k, *_ in bench.plan(["float32", "bfloat16"], [20, 24], [24], 4096)]
    assert kinds.count("activations") == 2 and kinds.count("kernels") == 2 * 3



def test_sanitizer_case_routes_every_moe_layout_and_lora(monkeypatch):
    """The experts' and LoRA's case, run on the CPU: its float64 references agree with the op in
    float32, and it names every layout of ckpt_ext.MOE_LAYOUTS."""
    case = _script("gpu_sanitize_case.py")
    assert "routed torch.float32" in [name for name, _, _ in case.cases()]
    monkeypatch.setattr(case, "DEVICE", "cpu")
    case.routed(torch.float32)
    with pytest.raises(AssertionError, match="moe_experts concatenated"):
        monkeypatch.setitem(case.MLP_TOL, torch.float32, 1e-12)
        case.routed(torch.float32)

def test_the_tests_step_imports_only_files_with_cuda_tests():
    plugin = _script("gpu_check_pytest.py")
    assert plugin.holds_cuda_tests("import pytest\npytestmark = pytest.mark.cuda\n")
    assert plugin.holds_cuda_tests("def test_x(\n    seed,\n    device):\n    pass\n")
    assert not plugin.holds_cuda_tests("import numpy\ndef test_x(seed):\n    x = 'device'\n")
    files = plugin.cuda_test_files(os.path.join(ROOT, "tests"))
    assert os.path.join(ROOT, "tests", "ops", "test_ops_cuda.py") in files
    # a module importing a package the GPU machine lacks, with no CUDA test, is not collected
    assert os.path.join(ROOT, "tests", "ops", "test_cpu_dispatch.py") not in files
