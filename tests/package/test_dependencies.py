"""The package imports and works without an NVIDIA driver, and pynvml is an optional tool.

pynvml must come from NVIDIA's `nvidia-ml-py` distribution (the old `pynvml` package on PyPI is a
deprecated wrapper), and no module of ckpt_ext may import it at import time: only the code that
reads GPU memory imports it, inside the function that uses it.
"""
from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_IMPORT_ALL = r"""
import importlib, pkgutil, sys
sys.modules["pynvml"] = None  # as if nvidia-ml-py were not installed: `import pynvml` raises
import ckpt_ext
names = [m.name for m in pkgutil.walk_packages(ckpt_ext.__path__, "ckpt_ext.")
         if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
import torch
x = torch.randn(3, 4, requires_grad=True)
w = torch.randn(2, 4, requires_grad=True)
ckpt_ext.linear_tanh(x, w).sum().backward()
assert x.grad is not None and w.grad is not None
print("IMPORTED", len(names), torch.cuda.is_initialized())
"""


def test_imports_without_driver_and_without_pynvml():
    # CUDA_VISIBLE_DEVICES="" hides any GPU, as on a machine with no NVIDIA driver (this CI
    # machine has none at all).
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = [l for l in proc.stdout.splitlines() if l.startswith("IMPORTED")][-1]
    _, count, cuda_initialised = line.split()
    assert int(count) >= 3  # ops, modules, convert at least
    assert cuda_initialised == "False"


class _ModuleLevelImports(ast.NodeVisitor):
    """Line numbers of `import pynvml` / `from pynvml import ...` outside any function."""

    def __init__(self):
        self.lines = []

    def visit_FunctionDef(self, node):  # an import inside a function runs only when it is called
        pass

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node):
        if any(a.name.split(".")[0] == "pynvml" for a in node.names):
            self.lines.append(node.lineno)

    def visit_ImportFrom(self, node):
        if (node.module or "").split(".")[0] == "pynvml":
            self.lines.append(node.lineno)


def _module_level_pynvml(source: str):
    v = _ModuleLevelImports()
    v.visit(ast.parse(source))
    return v.lines


def test_pynvml_is_imported_only_inside_functions():
    # (`import torch` may itself import pynvml when present, so sys.modules cannot tell who did;
    # the source can.) The checker itself first, on code it must flag and code it must not:
    assert _module_level_pynvml("import pynvml\ntry:\n    from pynvml import nvmlInit\n"
                                "except ImportError:\n    pass\n") == [1, 3]
    assert _module_level_pynvml("def f():\n    import pynvml\nclass A:\n"
                                "    def g(self):\n        from pynvml import x\n") == []
    offenders = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "ckpt_ext")):
        for fname in sorted(files):
            if fname.endswith(".py"):
                path = os.path.join(dirpath, fname)
                offenders += [f"{os.path.relpath(path, ROOT)}:{n}"
                              for n in _module_level_pynvml(open(path).read())]
    assert offenders == [], "pynvml imported at module level: " + ", ".join(offenders)


def test_pynvml_comes_from_nvidia_ml_py():
    reqs = open(os.path.join(ROOT, "requirements.txt")).read()
    names = [re.split(r"[<>=!~\[; ]", l.strip())[0].lower() for l in reqs.splitlines()
             if l.strip() and not l.startswith("#")]
    assert "nvidia-ml-py" in names and "pynvml" not in names
    try:
        dists = importlib.metadata.packages_distributions().get("pynvml")
    except Exception as e:  # pragma: no cover - very old importlib
        pytest.skip(f"cannot map modules to distributions here: {e}")
    if dists is None:
        pytest.skip("pynvml is not installed in this environment (it is optional)")
    assert dists == ["nvidia-ml-py"], dists
