#!/usr/bin/env bash
# Sets everything up from nothing: a venv with the pinned torch and the tools, then the build of
# ckpt_ext into it. Safe to re-run, and offline once set up: finished steps are skipped, pip is
# not called when nothing is missing.
#
#   bash scripts/setup.sh                                    # .venv, python3, torch of requirements.txt
#   PYTHON=python3.12 VENV=.venv-torch2.11 TORCH=2.11.0 bash scripts/setup.sh
#       another torch of the supported range (and another Python) beside it: the build goes in
#       place as ckpt_ext/_C<the interpreter's EXT_SUFFIX>, so venvs of different Pythons share
#       the tree; venvs of one Python share one module file, so build one at a time.
#   PIP_CONSTRAINT=/dev/null PYTHON=python3.13 VENV=.venv-torch2.15 TORCH=2.15.0 \
#     bash scripts/setup.sh
#       a torch above the cap of a pip constraint file (this machine's caps torch at the default):
#       the variable lifts it for this call's pip alone, so for this venv alone (make test-newest).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH=${TORCH:-}
export PIP_DISABLE_PIP_VERSION_CHECK=1  # no call home from pip on re-runs

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# requirements.txt pins the default torch; TORCH=X.Y.Z replaces that pin (the test extras stay).
REQ=$VENV/.ckpt_ext_requirements.txt
if [ -n "$TORCH" ]; then
  sed -E "s/^torch==[^ #]*/torch==$TORCH/" requirements.txt >"$REQ"
else
  cp requirements.txt "$REQ"
fi
# pip runs only when the requirements changed since it last ran here (the stamp holds their
# sha256) or something they list is missing or at a wrong version (scripts/check_requirements.py
# reads installed metadata).
REQ_STAMP="$VENV/.ckpt_ext_requirements.sha256"
REQ_SUM=$(sha256sum "$REQ" | cut -d' ' -f1)
if [ "$(cat "$REQ_STAMP" 2>/dev/null)" = "$REQ_SUM" ] \
    && "$VENV/bin/python" scripts/check_requirements.py "$REQ" >/dev/null \
    && "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "ckpt_ext: requirements installed and unchanged; pip not run"
else
  "$VENV/bin/python" -m pip install -q -r "$REQ"
  "$VENV/bin/python" scripts/check_requirements.py "$REQ"
  echo "$REQ_SUM" >"$REQ_STAMP"
fi

# The build: setup.py builds the CUDA kernels when torch is a CUDA build and nvcc is found
# (CKPT_EXT_CUDA=0|1 forces either; CUDA_HOME and TORCH_CUDA_ARCH_LIST are honoured; the CPU
# kernels are built for every ISA level and chosen at run time). pip builds in a fresh temporary
# folder on every editable install, and the CUDA build takes minutes, so it is skipped when this
# interpreter's module is newer than every source and was made with the same settings. (pip needs
# no network here: no build isolation, no dependencies.)
PYABS=$(cd "$(dirname "$VENV/bin/python")" && pwd)/python
SETTINGS="torch=$("$PYABS" -c 'import torch; print(torch.__version__)') CKPT_EXT_CUDA=${CKPT_EXT_CUDA:-auto} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-} CUDA_HOME=${CUDA_HOME:-}"
STAMP="$VENV/.ckpt_ext_build_settings"
SO=ckpt_ext/_C$("$PYABS" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
if [ -f "$SO" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$SETTINGS" ] \
    && [ -z "$(find csrc setup.py pyproject.toml -newer "$SO" -print -quit)" ] \
    && (cd / && "$PYABS" -c "import ckpt_ext") 2>/dev/null; then
  echo "ckpt_ext: build up to date ($SO), not rebuilt"
else
  "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps --no-index -e .
  echo "$SETTINGS" >"$STAMP"
fi
"$VENV/bin/python" -c "import ckpt_ext, torch; print('ckpt_ext ready: torch', torch.__version__, '| CUDA kernels built:', ckpt_ext.WITH_CUDA, '| CPU kernels:', ckpt_ext._C._cpu_capability())"
# No silent CPU-only fallback: where auto mode should have built the kernels, fail loudly.
if [ "${CKPT_EXT_CUDA:-auto}" != 0 ] && command -v nvcc >/dev/null \
    && "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.version.cuda is None)"; then
  "$VENV/bin/python" -c "import ckpt_ext, sys; sys.exit(not ckpt_ext.WITH_CUDA)" || {
    echo "ckpt_ext: nvcc and a CUDA torch are here, but the CUDA kernels were not built" >&2; exit 1; }
fi
