"""pytest plugin of gpu_check.sh's tests step (`-p gpu_check_pytest`, scripts/ on PYTHONPATH).

Order by value. The tests run in two rounds, so that a step stopped by its cap loses the least
valuable ones: first a cover, in every test function (file order, the files named in
$GPU_CHECK_TESTS_FIRST first), the cases that reach each value of each of its parameters that has
at most SWEEP values, each one in every dtype (activation, layout, bias: each kernel family in each
dtype); then the rest, the functions with the fewest cases left first, so the long sweeps (a width
or size range: more than SWEEP values) run last.

Which files. `python scripts/gpu_check_pytest.py tests` prints the test files that hold a CUDA
test (a `cuda` mark written in the file, or a test taking the `device` fixture, whose "cuda"
parameter carries the mark), read with ast, without importing them: the step collects only those,
so a module that needs a package the GPU machine lacks (and holds no CUDA test) is never imported.

Results as they end. One JSON line per test phase into $GPU_CHECK_TESTS_JSONL, flushed at once,
so a run killed at its cap keeps every result before it and names the test that was running; a
first line gives the number of tests selected and the size of the cover (then "not run" is
selected minus finished)."""
from __future__ import annotations

import ast
import json
import os
import sys

import pytest

SWEEP = 8  # a parameter with more values than this in one function is a sweep


def _is_dtype(name, value):
    return name == "dtype" or type(value).__name__ == "dtype" and type(value).__module__ == "torch"


def value_order(cases, first=()):
    """cases: (nodeid, params) in collection order, params a dict name -> value. Returns
    (order, cover): the indices of `cases` in the order to run them, and how many of them form
    the first round (the cover)."""
    def rank(nodeid):
        path = nodeid.split("::")[0]
        hits = [i for i, f in enumerate(first) if path == f or path.startswith(f.rstrip("/") + "/")]
        return hits[0] if hits else len(first)

    functions = {}  # function id -> indices of its cases, in collection order
    for i, (nodeid, _) in enumerate(cases):
        functions.setdefault(nodeid.split("[")[0], []).append(i)
    ordered = sorted(functions.values(), key=lambda idx: (rank(cases[idx[0]][0]), idx[0]))

    cover, rest = [], []
    for idx in ordered:
        values = {}
        for i in idx:
            for name, v in cases[i][1].items():
                values.setdefault(name, set()).add(repr(v))
        small = {name for name, vs in values.items() if len(vs) <= SWEEP}
        seen, left = set(), []
        for i in idx:
            params = {name: v for name, v in cases[i][1].items() if name in small}
            dtypes = [(name, repr(v)) for name, v in params.items() if _is_dtype(name, v)]
            new = {(name, repr(v)) + d for name, v in params.items() for d in [()] + dtypes
                   if d[:1] != (name,)} - seen
            if new or i == idx[0]:
                cover.append(i)
                seen |= new
            else:
                left.append(i)
        if left:
            rest.append(left)
    rest.sort(key=lambda left: len(left))  # stable: equal sizes keep the file order
    return cover + [i for left in rest for i in left], len(cover)


def holds_cuda_tests(source: str) -> bool:
    """A `pytest.mark.cuda` anywhere in the file, or a test function taking `device`."""
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr == "cuda"
                and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"):
            return True
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.name.startswith("test") and any(a.arg == "device" for a in node.args.args)):
            return True
    return False


def cuda_test_files(root: str) -> list:
    out = []
    for d, _, files in os.walk(root):
        for f in files:
            if f.startswith("test_") and f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path, encoding="utf-8") as fh:
                    if holds_cuda_tests(fh.read()):
                        out.append(path)
    return sorted(out)


_f = open(os.environ["GPU_CHECK_TESTS_JSONL"], "a", buffering=1) \
    if os.environ.get("GPU_CHECK_TESTS_JSONL") else None


def _w(**kw):
    if _f is not None:
        _f.write(json.dumps(kw) + "\n")


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected
def pytest_collection_modifyitems(session, config, items):
    cases = [(item.nodeid, dict(getattr(getattr(item, "callspec", None), "params", {})))
             for item in items]
    order, n_cover = value_order(cases, os.environ.get("GPU_CHECK_TESTS_FIRST", "").split())
    items[:] = [items[i] for i in order]
    _w(selected=len(items), cover=n_cover)
    if os.environ.get("GPU_CHECK_TESTS_ORDER"):  # the whole order, for the rehearsal's record
        with open(os.environ["GPU_CHECK_TESTS_ORDER"], "w") as f:
            f.write("".join(f"{item.nodeid}\n" for item in items))


def _msg(report):
    """A skip's reason, or a failure's one-line message."""
    lr = report.longrepr
    if isinstance(lr, tuple):
        return str(lr[2])
    crash = getattr(lr, "reprcrash", None)
    return crash.message if crash is not None else (str(lr).strip().splitlines() or [""])[-1]


def pytest_runtest_logstart(nodeid, location):
    _w(start=nodeid)


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        _w(id=report.nodeid, when=report.when, outcome=report.outcome, s=round(report.duration, 3),
           msg="" if report.outcome == "passed" else _msg(report)[:300])


def pytest_collectreport(report):
    if report.failed:
        _w(id=report.nodeid, when="collect", outcome="failed", s=0, msg=_msg(report)[:300])


if __name__ == "__main__":
    print("\n".join(cuda_test_files(sys.argv[1] if len(sys.argv) > 1 else "tests")))
