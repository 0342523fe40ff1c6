#!/usr/bin/env bash
# The wheel, as a user gets it: `pip wheel --no-build-isolation --no-deps .`, installed into a
# fresh virtual environment that shares the set-up venv's torch, then a smoke subset of the tests
# run from outside the source tree against the installed package. Run by .ci/run after `make
# test`; needs the venv of scripts/setup.sh. Offline: nothing is downloaded.
#
# The fresh venv sees the set-up venv's packages through one .pth line naming its site-packages.
# A .pth line only adds a path: the .pth files inside that folder (among them the editable
# install's finder of the source tree) are not run, so the only ckpt_ext it can import is the
# wheel's. The script checks that from ckpt_ext.__file__.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${VENV:-.venv}
export PIP_DISABLE_PIP_VERSION_CHECK=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ckpt_ext_wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

if [ -z "${WHEEL:-}" ]; then  # WHEEL=path: check a wheel built before instead
  "$VENV/bin/python" -m pip wheel -q --no-build-isolation --no-deps --no-index -w "$WORK/dist" .
  WHEEL=$(ls "$WORK"/dist/ckpt_ext-*.whl)
  echo "wheel-check: built $(basename "$WHEEL")"
fi

# --without-pip: a venv's own pip and setuptools would shadow the newer setuptools torch requires,
# and the offline install below would then try to upgrade it. The set-up venv's pip installs.
"$VENV/bin/python" -m venv --without-pip "$WORK/venv"
WSITE=$("$WORK/venv/bin/python" -c "import site; print(site.getsitepackages()[0])")
# Every site-packages folder the set-up venv sees (its own, and any it layers on through .pth
# lines of its own); not the source tree, which an editable install may put on its path.
"$VENV/bin/python" -c "import os, sys; print('\n'.join(p for p in sys.path
    if os.path.basename(p) in ('site-packages', 'dist-packages')))" >"$WSITE/ckpt_ext_base_venv.pth"
# Dependencies resolved offline against what the .pth makes visible: a wheel whose torch
# requirement does not match the torch here fails to install.
"$VENV/bin/python" -m pip --python "$WORK/venv/bin/python" install -q --no-index "$WHEEL"

# Tests copied out of the tree and run from there: nothing can import the source checkout.
cp -r tests "$WORK/tests"
cd "$WORK"
"$WORK/venv/bin/python" - "$WSITE" <<'PY'
import os, sys, ckpt_ext, torch
site = os.path.realpath(sys.argv[1])
where = os.path.realpath(ckpt_ext.__file__)
assert where.startswith(site + os.sep), f"imported ckpt_ext from {where}, not the wheel in {site}"
print(f"wheel-check: ckpt_ext from {where}; torch {torch.__version__}; "
      f"CPU kernels {ckpt_ext._C._cpu_capability()}; CUDA kernels {ckpt_ext.WITH_CUDA}")
PY
"$WORK/venv/bin/python" -m pytest -q -rs -p no:cacheprovider tests/package/test_build.py \
  tests/ops/test_cpu_dispatch.py tests/memory/test_meter.py tests/ops/test_ops.py
cd "$REPO"
