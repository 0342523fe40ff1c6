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

"$VENV/bin/python" -m pip wheel -q --no-build-isolation --no-deps --no-index -w "$WORK/dist" .
WHEEL=$(ls "$WORK"/dist/ckpt_ext-*.whl)
echo "wheel-check: built $(basename "$WHEEL")"

"$VENV/bin/python" -m venv "$WORK/venv"
BASE_SITE=$("$VENV/bin/python" -c "import site; print(site.getsitepackages()[0])")
WSITE=$("$WORK/venv/bin/python" -c "import site; print(site.getsitepackages()[0])")
echo "$BASE_SITE" >"$WSITE/ckpt_ext_base_venv.pth"
# Dependencies resolved offline against what the .pth makes visible: a wheel whose torch
# requirement does not match the torch here fails to install.
"$WORK/venv/bin/python" -m pip install -q --no-index "$WHEEL"

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
"$WORK/venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_build.py \
  tests/test_cpu_dispatch.py tests/test_meter.py tests/test_ops.py
cd "$REPO"
