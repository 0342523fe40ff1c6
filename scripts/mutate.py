#!/usr/bin/env python
"""scripts/mutate.py — does the test suite catch the bugs it claims to catch?

Swaps deliberately wrong kernels into a copy of the source tree, one at a time, builds each
mutant CPU-only, runs the chosen tests against it and reports which tests fail ("catch" it). A
mutant that no test catches is a hole in the suite; the script then exits 1. An unpatched
control build runs the same tests first and must pass, or the figures mean nothing.

    python scripts/mutate.py                      # every mutant; test_ops.py, test_property.py
    python scripts/mutate.py --list               # the table of mutants
    python scripts/mutate.py --only stale_recompute --tests tests/ops/test_ops.py
    nice python scripts/mutate.py --keep /tmp/mut # keep the tree (its build/ makes a rerun fast)

How. The tree is copied once (the files git tracks, plus untracked ones it does not ignore) into a
temporary directory and built there with `CKPT_EXT_CUDA=0 setup.py build_ext --inplace`; each
mutant patches one file in that copy, ninja rebuilds only that translation unit, the tests run
from the copy's root (so its ckpt_ext is imported), and the file is restored. Each run takes
about 1-3 minutes per mutant on a 2-core machine.

Retargeting. MUTANTS is one table of rows (name, file, old text, new text, what it breaks). A
row applies when `old` occurs exactly once in `file`. Rows sharing a name are alternatives for
different layouts of the code, tried in order, the first that applies is used (a row can be added
beside the current one while a branch moves the code). A mutant none of whose rows applies is reported as "does not apply: retarget"
and counts as a failure of this script, so the table cannot silently go stale.
`--source-root DIR` takes the sources (csrc/, setup.py, ckpt_ext/) from another checkout and the
tests from this one, to run this table against a branch before it merges.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str   # relative to the repository root
    old: str    # must occur exactly once in file
    new: str
    breaks: str  # what is wrong, in words


CPU = "csrc/cpu/primitives.cpp"              # the CPU primitives: threads, bias sums
CPU_KERNELS = "csrc/cpu/kernels.cpp"  # the per-ISA element kernels
ENGINE = "csrc/stack.cpp"  # the stack engine: recompute, GEMMs, buffers

_COMBINE = "      out[col] = static_cast<scalar_t>(combine_chunks_pairwise(partial, C, N, col));\n"

MUTANTS = [
    Mutant(
        "bias_grad_off_by_1e-4", CPU, _COMBINE,
        "      out[col] = static_cast<scalar_t>(combine_chunks_pairwise(partial, C, N, col) *\n"
        "                                       static_cast<at::opmath_type<scalar_t>>(1.0001));\n",
        "every bias gradient 1e-4 (relative) too large"),
    Mutant(
        "dropped_factor_in_one_column", CPU_KERNELS,
        "        t.v[i] = tanh_grad_from_output(gy.v[i], t.v[i]);\n"
        "      }\n"
        "      t.store(row + c, k);\n",
        "        t.v[i] = tanh_grad_from_output(gy.v[i], t.v[i]);\n"
        "      }\n"
        "      if (c + k == N) {  // the last column keeps grad_out: the (1 - t^2) factor dropped\n"
        "        scalar_t tmp[W];\n"
        "        t.store(tmp, k);\n"
        "        tmp[k - 1] = sc == 0 ? grad_row[0] : grad_row[(N - 1) * sc];\n"
        "        t = Step<scalar_t>::load(tmp, k);\n"
        "      }\n"
        "      t.store(row + c, k);\n",
        "every dtype: g = grad_out in the last column, without 1 - tanh(z)^2"),
    Mutant(
        "stale_recompute", ENGINE,
        "  if (last_tanh) top_z = pre_activation(acts[L - 1], weights[L - 1], b[L - 1]);\n",
        "  if (last_tanh) {  // the recompute cached across calls of the same shape and dtype\n"
        "    static at::Tensor stale;\n"
        "    if (!stale.defined() || stale.size(0) != acts[L - 1].size(0) ||\n"
        "        stale.size(1) != weights[L - 1].size(0) ||\n"
        "        stale.scalar_type() != x.scalar_type() || stale.device() != x.device()) {\n"
        "      stale = pre_activation(acts[L - 1], weights[L - 1], b[L - 1]);\n"
        "    }\n"
        "    top_z = stale.clone();\n"
        "  }\n",
        "backward reuses the z recomputed by an earlier call of the same shape"),
    Mutant(
        "summation_order_left_to_right", CPU, _COMBINE,
        "      at::opmath_type<scalar_t> s = 0;  // chunk sums left to right, not pairwise\n"
        "      for (int64_t i = 0; i < C; ++i) s += partial[i * N + col];\n"
        "      out[col] = static_cast<scalar_t>(s);\n",
        "bias gradient: chunk sums combined left to right instead of pairwise"),
    Mutant(
        "summation_order_aten_sum", ENGINE,
        "      grad_b = tanh_backward_(g, grad, top ? Holds::kPreActivation : Holds::kTanhOutput,\n"
        "                              need_bias[i]);\n",
        "      tanh_backward_(g, grad, top ? Holds::kPreActivation : Holds::kTanhOutput, false);\n"
        "      if (need_bias[i]) grad_b = g.sum(0);  // ATen's own order\n",
        "bias gradient summed by ATen's sum(0) instead of the documented order"),
    Mutant(
        "half_arithmetic_in_storage_precision", CPU_KERNELS,
        "        t.v[i] = tanh_grad_from_output(gy.v[i], t.v[i]);\n",
        "        if constexpr (kReduced<scalar_t>) {  // t, t*t, 1 - t*t, the product rounded\n"
        "          using F = Vectorized<float>;\n"
        "          auto rd = [](F v) {\n"
        "            return std::get<0>(at::vec::convert_to_float<scalar_t>(\n"
        "                at::vec::convert_from_float<scalar_t>(v, v)));\n"
        "          };\n"
        "          const F tr = rd(t.v[i]);\n"
        "          t.v[i] = rd(gy.v[i] * rd(F(1) - rd(tr * tr)));\n"
        "        } else {\n"
        "          t.v[i] = tanh_grad_from_output(gy.v[i], t.v[i]);\n"
        "        }\n",
        "bfloat16/float16 backward arithmetic in the storage type instead of float32"),
    Mutant(
        "bias_added_after_the_gemm", ENGINE,
        "    at::addmm_out(out, *bias, a, weight.t());\n",
        "    at::mm_out(out, a, weight.t());\n"
        "    out.add_(*bias);  // z rounded twice in half types\n",
        "z = round(round(x·Wᵀ) + b): the bias added after the GEMM, forward and recompute"),
]


# ------------------------------------------------------------------------------------------------

def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _tree_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=root, check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p and (root / p).is_file()]


def _copy_file(source: Path, target: Path) -> None:
    if target.exists() and target.read_bytes() == source.read_bytes():
        return  # unchanged since an earlier run (--keep): ninja keeps its object file
    target.parent.mkdir(parents=True, exist_ok=True)
    # shutil.copy, not copy2: the copy must be newer than any object file built from what it
    # replaces (e.g. a mutant left behind by a killed run), or ninja keeps that stale object.
    shutil.copy(source, target)


def _copy_tree(root: Path, dest: Path) -> None:
    for rel in _tree_files(root):
        _copy_file(root / rel, dest / rel)


def _build(tree: Path, log: Path) -> bool:
    env = dict(os.environ, CKPT_EXT_CUDA="0", MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                           cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT)
    return r.returncode == 0


def _run_tests(tree: Path, tests: list[str], extra: list[str], junit: Path) -> tuple[int, list]:
    """(pytest's exit code, [(test id, 'failed'|'error')])."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cuda",
           f"--junitxml={junit}", *extra, *tests]
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    bad = []
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            for kind in ("failure", "error"):
                if case.find(kind) is not None:
                    file = case.get("classname", "").split(".")[-1]
                    bad.append((f"{file}.py::{case.get('name')}", kind))
    elif r.returncode != 0:
        bad.append(("<pytest did not run>: " + (r.stdout + r.stderr)[-400:], "error"))
    return r.returncode, bad


def _group(bad: list) -> "OrderedDict[str, int]":
    """test id -> number of failing parametrisations."""
    groups: "OrderedDict[str, int]" = OrderedDict()
    for test_id, _ in bad:
        key = test_id.split("[")[0]
        groups[key] = groups.get(key, 0) + 1
    return groups


def _applicable(tree: Path, rows: list) -> Mutant | None:
    """The first row (of one mutant's alternatives) whose old text occurs exactly once."""
    for m in rows:
        path = tree / m.file
        if path.exists() and path.read_text().count(m.old) == 1:
            return m
    return None


def _apply(tree: Path, m: Mutant) -> str:
    """Patch the copy with one applicable row; returns the file's original text."""
    path = tree / m.file
    text = path.read_text()
    path.write_text(text.replace(m.old, m.new))
    return text


def _by_name(rows: list) -> "OrderedDict[str, list]":
    out: "OrderedDict[str, list]" = OrderedDict()
    for m in rows:
        out.setdefault(m.name, []).append(m)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", nargs="+",
                    default=["tests/ops/test_ops.py", "tests/ops/test_property.py"],
                    help="test files or ids to run against each mutant")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    ap.add_argument("--keep", metavar="DIR", help="build in DIR and keep it (reused if present)")
    ap.add_argument("--list", action="store_true", help="print the table of mutants and exit")
    ap.add_argument("--check-patches", action="store_true",
                    help="only check that every patch applies to this tree (no build)")
    ap.add_argument("--source-root", metavar="DIR",
                    help="take the sources from this checkout (the tests from this one)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args()

    known = _by_name(MUTANTS)
    if args.only and set(args.only) - set(known):
        ap.error(f"unknown mutant in {args.only}; known: {list(known)}")
    mutants = OrderedDict((k, v) for k, v in known.items() if not args.only or k in args.only)
    source_root = Path(args.source_root).resolve() if args.source_root else ROOT
    if args.list or args.check_patches:
        print(f"Patches against {source_root}\n")
        print("| mutant | file | applies | what it breaks |\n|---|---|---|---|")
        ok = True
        for name, rows in mutants.items():
            used = _applicable(source_root, rows)
            ok &= used is not None
            for m in rows:
                state = "yes (used)" if m is used else ("no" if used else "NO: retarget")
                print(f"| {m.name} | {m.file} | {state} | {m.breaks} |")
        return 0 if ok or args.list else 1

    tree = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ckpt_ext_mutate_"))
    tree.mkdir(parents=True, exist_ok=True)
    logs = tree / "_mutate_logs"
    logs.mkdir(exist_ok=True)
    _log(f"mutate: tree {tree}; tests {' '.join(args.tests)}")
    rows = []
    try:
        _copy_tree(source_root, tree)
        if source_root != ROOT:  # this checkout's tests and scripts over the other's sources
            for rel in _tree_files(ROOT):
                if rel.startswith(("tests/", "scripts/")):
                    _copy_file(ROOT / rel, tree / rel)
        t0 = time.time()
        if not _build(tree, logs / "control-build.log"):
            _log(f"mutate: the unpatched tree does not build; see {logs / 'control-build.log'}")
            return 2
        code, bad = _run_tests(tree, args.tests, args.pytest_args, logs / "control.xml")
        _log(f"mutate: control built and tested in {time.time() - t0:.0f} s: pytest exit {code}")
        if code != 0 or bad:
            _log("mutate: the control (no mutation) fails these tests, fix them first:\n  " +
                 "\n  ".join(t for t, _ in bad))
            return 2
        for name, alternatives in mutants.items():
            t0 = time.time()
            m = _applicable(tree, alternatives)
            if m is None:
                rows.append((alternatives[0], "does not apply: retarget", None))
                continue
            original = _apply(tree, m)
            try:
                if not _build(tree, logs / f"{m.name}-build.log"):
                    rows.append((m, f"does not build (see {logs / (m.name + '-build.log')})", None))
                    continue
                code, bad = _run_tests(tree, args.tests, args.pytest_args, logs / f"{m.name}.xml")
            finally:
                (tree / m.file).write_text(original)
            verdict = "caught" if bad else "NOT CAUGHT"
            rows.append((m, verdict, _group(bad)))
            _log(f"mutate: {m.name}: {verdict} ({len(bad)} failing tests, "
                 f"{time.time() - t0:.0f} s)")
        # leave the copy's build matching its sources
        _build(tree, logs / "restore-build.log")
    finally:
        if not args.keep:
            shutil.rmtree(tree, ignore_errors=True)

    print(f"\nMutation check: {len(rows)} mutants, tests: {' '.join(args.tests)}\n")
    print("| mutant | file | verdict | failing tests (parametrisations) |")
    print("|---|---|---|---|")
    for m, verdict, groups in rows:
        caught_by = "; ".join(f"{k.split('::')[-1]} ({v})" for k, v in (groups or {}).items())
        print(f"| {m.name} | {m.file} | {verdict} | {caught_by or '-'} |")
    return 0 if all(v == "caught" for _, v, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
