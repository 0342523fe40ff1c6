# The two commands of the README: `make bench` (the main job) and `make test`. Both set
# everything up first (scripts/setup.sh: venv, pinned torch, build), so they work on a fresh clone.
# `make test-oldest` builds and tests against the oldest supported torch, as the GPU machine has it
# (torch 2.11 on Python 3.12), in a venv of its own beside .venv.
PYTHON := .venv/bin/python
OLDEST_TORCH := 2.11.0
OLDEST_VENV := .venv-torch2.11
# Python 3.12 for the oldest-torch venv: on PATH, else pyenv's. Its own extension suffix lets its
# in-place build sit beside .venv's (Python 3.11) in one tree.
PYTHON312 ?= $(shell for p in python3.12 $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12; do \
  "$$p" -c "" 2>/dev/null && echo "$$p" && break; done)

.PHONY: setup test test-oldest bench demo clean

setup:
	bash scripts/setup.sh

# Where nvcc is on PATH the build must have the CUDA kernels; CKPT_EXT_EXPECT_CUDA makes a test
# fail on a silent CPU-only build (tests/ops/test_ops_cuda.py).
EXPECT_CUDA = CKPT_EXT_EXPECT_CUDA=$$(command -v nvcc >/dev/null && [ "$${CKPT_EXT_CUDA:-auto}" != 0 ] && echo 1)

test: setup
	$(EXPECT_CUDA) $(PYTHON) -m pytest -q tests

test-oldest:
	@[ -n "$(PYTHON312)" ] || { echo "make test-oldest: no Python 3.12 found (PYTHON312=...)" >&2; exit 1; }
	PYTHON=$(PYTHON312) VENV=$(OLDEST_VENV) TORCH=$(OLDEST_TORCH) bash scripts/setup.sh
	$(EXPECT_CUDA) $(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider tests

bench: setup
	$(PYTHON) -m ckpt_ext.bench

demo: bench

clean:
	rm -rf build *.egg-info ckpt_ext/*.so
