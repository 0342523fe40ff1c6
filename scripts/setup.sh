#!/usr/bin/env bash
# Sets everything up from nothing: a venv in .venv with the pinned torch and the tools, then the
# build of ckpt_ext into it. Safe to re-run: finished steps are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# torch is pinned; the rest are the build, test and benchmark tools.
"$VENV/bin/python" -m pip install -q -r requirements.txt

"$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e .
"$VENV/bin/python" -c "import ckpt_ext, torch; print('ckpt_ext ready: torch', torch.__version__, '| CUDA kernels built:', ckpt_ext.WITH_CUDA)"
