"""Loads the native module ckpt_ext._C, refusing one built against another torch.

A C++ extension is tied to the torch minor release it was compiled against. Loaded next to
another one it usually fails with an "undefined symbol" error before any of its own code runs,
and where it does load it may misbehave. So: if _C loads, its TORCH_BUILD_VERSION is compared
with the running torch; if it does not, the version is read from the file itself (the build
leaves a marker string in it, csrc/build_info.cpp) to say what is wrong. Both cases raise an
ImportError that names the two versions and how to rebuild.
"""
from __future__ import annotations

import glob
import os
import re
import sysconfig

import torch

_MARKER = re.compile(rb"ckpt_ext-built-with-torch=([0-9A-Za-z.+_-]+)")


def _major_minor(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)


def _mismatch(built: str, running: str) -> str:
    return (f"ckpt_ext was built against torch {built} but torch {running} is installed; a "
            f"compiled extension only loads with the torch major.minor it was built with. Rebuild "
            f"it against this torch (pip install --no-build-isolation -e . from the source tree, "
            f"or `make setup`), or install torch {'.'.join(map(str, _major_minor(built)))}.x.")


def _version_in_file() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    # This interpreter's module: builds for other Pythons may sit beside it (scripts/setup.sh).
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for path in glob.glob(os.path.join(here, "_C" + suffix)):
        try:
            with open(path, "rb") as f:
                m = _MARKER.search(f.read())
        except OSError:
            continue
        if m:
            return m.group(1).decode()
    return None


def check_versions(built: str, running: str) -> None:
    """Raise ImportError when ``built`` and ``running`` differ in major.minor."""
    if _major_minor(built) != _major_minor(running):
        raise ImportError(_mismatch(built, running))


try:
    from . import _C  # noqa: E402
except ImportError as e:
    built = _version_in_file()
    if built is not None and _major_minor(built) != _major_minor(torch.__version__):
        raise ImportError(_mismatch(built, torch.__version__)) from e
    raise

check_versions(_C.TORCH_BUILD_VERSION, torch.__version__)
