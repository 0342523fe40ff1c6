"""ckpt_ext's build backend: setuptools.build_meta, with torch added to the build requirements as
the very release installed where the package goes, so that `pip install .` (build isolation on)
builds against the user's torch and the wheel, which asks for the torch minor release it was built
against (setup.py's torch_requirement), never makes pip replace it. With no torch there, any
release of the tested range (setup.py's TESTED_TORCH), and pip installs the one it picks.

Where the package goes is the interpreter that runs pip, which runs these hooks with its own
executable. Its environment is asked in a child process started with -E: pip's isolated build
environment reaches this process through PYTHONPATH (its sitecustomize hides the real
site-packages) and PYTHONNOUSERSITE, and -E drops both, so the child sees the user's
site-packages, their --user site included. Only metadata is read; torch is not imported.
"""
import ast
import os
import subprocess
import sys
import tempfile

from setuptools.build_meta import *  # noqa: F401,F403  (every hook not wrapped below)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_ASK_TORCH = """
import importlib.metadata as m
try:
    print(m.version("torch"))
except m.PackageNotFoundError:
    pass
"""


def installed_torch(python=sys.executable):
    """The version of the torch distribution installed for `python`, or None when there is none.
    Run from an empty folder, so that the source tree (a child's first sys.path entry) is not
    searched."""
    with tempfile.TemporaryDirectory() as empty:
        proc = subprocess.run([python, "-E", "-c", _ASK_TORCH], capture_output=True, text=True,
                              timeout=120, cwd=empty)
    if proc.returncode != 0:
        raise SystemExit(f"ckpt_ext build: could not ask {python} which torch it has:\n"
                         f"{proc.stderr.strip()}")
    return proc.stdout.strip() or None


def tested_torch():
    """setup.py's TESTED_TORCH, ((oldest major, minor), (newest major, minor)), read from its
    source: setup.py runs setup() when executed, so it is parsed, not imported."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "TESTED_TORCH" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit("ckpt_ext build: setup.py defines no TESTED_TORCH")


def torch_build_requirement(version):
    """The build's torch: `version` exactly (local label included: a +cpu torch builds against
    +cpu, from the index the user gives pip), or the tested range when `version` is None."""
    if version is not None:
        return f"torch=={version}"
    (lo_major, lo_minor), (hi_major, hi_minor) = tested_torch()
    return f"torch>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}"


def _torch_requirement():
    version = installed_torch()
    req = torch_build_requirement(version)
    where = f"torch {version} is installed" if version else "no torch is installed"
    print(f"ckpt_ext build: {where} for {sys.executable}: building against {req}",
          file=sys.stderr)
    return [req]


# setuptools' own get_requires_* hooks run setup.py to collect its setup_requires, and setup.py
# imports torch, which is not in the build env yet: these hooks return the torch alone (the
# rest is pyproject.toml's build-system.requires). setup.py imports torch for every build, the
# sdist's included (its metadata names the torch).
def get_requires_for_build_wheel(config_settings=None):
    return _torch_requirement()


def get_requires_for_build_editable(config_settings=None):
    return _torch_requirement()


def get_requires_for_build_sdist(config_settings=None):
    return _torch_requirement()
