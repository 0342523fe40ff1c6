# The two commands of the README: `make bench` (the main job: the README's figures, a few minutes)
# and `make test`. Both set everything up first (scripts/setup.sh: venv, pinned torch, build), so
# they work on a fresh clone. `make bench-full` runs the benchmark's whole matrix (every network and
# mode), `make bench-plan` its plan section (ckpt_ext.plan against the other ways to fit a budget).
# `make test-dispatch` runs tests/ops and tests/fuse's float32 and generate() comparisons with
# MKL's, oneDNN's and ATen's kernel choice moved off this machine's default (docs/testing.md, "The
# dispatch step"), so a test that leans on one CPU's kernels fails here first.
# `make test-oldest` builds and tests against the oldest supported torch, as the GPU machine has it
# (torch 2.11 on Python 3.12), and `make test-newest` against the newest (torch 2.15 on Python
# 3.13), each in a venv of its own beside .venv.
PYTHON := .venv/bin/python
OLDEST_TORCH := 2.11.0
OLDEST_VENV := .venv-torch2.11
NEWEST_TORCH := 2.15.0
NEWEST_VENV := .venv-torch2.15
# A Python of each version: on PATH, else pyenv's. Each has its own extension suffix, so the
# in-place builds of .venv (Python 3.11) and of both legs sit side by side in one tree.
find_python = $(shell for p in python$(1) $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$(1).*/bin/python$(1); do \
  "$$p" -c "" 2>/dev/null && echo "$$p" && break; done)
PYTHON312 ?= $(call find_python,3.12)
PYTHON313 ?= $(call find_python,3.13)

.PHONY: setup test test-dispatch test-oldest test-newest bench bench-full bench-plan demo clean

setup:
	bash scripts/setup.sh

# Where nvcc is on PATH the build must have the CUDA kernels; CKPT_EXT_EXPECT_CUDA makes a test
# fail on a silent CPU-only build (tests/ops/test_ops_cuda.py).
EXPECT_CUDA = CKPT_EXT_EXPECT_CUDA=$$(command -v nvcc >/dev/null && [ "$${CKPT_EXT_CUDA:-auto}" != 0 ] && echo 1)

test: setup
	$(EXPECT_CUDA) $(PYTHON) -m pytest -q tests

# What each variable moves (torch 2.14's bundled libraries on an AMD EPYC, docs/testing.md):
# MKL_CBWR MKL's float32/float64 GEMM kernels; ONEDNN_MAX_CPU_ISA oneDNN's bfloat16 GEMMs;
# ATEN_CPU_CAPABILITY ATen's vectorised kernels and ckpt_ext's own level with them.
# MKL_ENABLE_INSTRUCTIONS changed no bit there; MKL documents it for Intel CPUs.
DISPATCH_ENV := MKL_CBWR=COMPATIBLE MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
  ATEN_CPU_CAPABILITY=avx2

# tests/ops, and of tests/fuse the float32 and generate() comparisons of fused against unfused
# (these add ~25 s on 2 cores).
DISPATCH_TESTS := tests/ops tests/fuse/test_fuse_moe.py tests/fuse/test_fuse_mixed.py \
  tests/fuse/test_fuse_conv1d.py::test_gpt2_generate_save_and_unfuse \
  tests/fuse/test_fuse_gated.py::test_llama_generate_save_and_unfuse \
  tests/fuse/test_fuse_encoder_decoder.py::test_bart_generate_gives_the_same_tokens

# Inductor's cache does not key its compiled code on ATEN_CPU_CAPABILITY: code cached under it
# and loaded by a later run without it corrupted the heap (tests/ops/test_compile.py aborted in
# `make test`). So this step compiles into a cache of its own, removed after it.
test-dispatch: setup
	cache=$$(mktemp -d); trap 'rm -rf "$$cache"' EXIT; \
	  TORCHINDUCTOR_CACHE_DIR=$$cache $(DISPATCH_ENV) $(PYTHON) -m pytest -q -p no:cacheprovider \
	  $(DISPATCH_TESTS)

test-oldest:
	@[ -n "$(PYTHON312)" ] || { echo "make test-oldest: no Python 3.12 found (PYTHON312=...)" >&2; exit 1; }
	PYTHON=$(PYTHON312) VENV=$(OLDEST_VENV) TORCH=$(OLDEST_TORCH) bash scripts/setup.sh
	$(EXPECT_CUDA) $(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider tests

# PIP_CONSTRAINT=/dev/null: a pip constraint file may cap torch below the newest (this machine's
# caps it at the default); lifted for this venv's set-up alone.
test-newest:
	@[ -n "$(PYTHON313)" ] || { echo "make test-newest: no Python 3.13 found (PYTHON313=...)" >&2; exit 1; }
	PIP_CONSTRAINT=/dev/null PYTHON=$(PYTHON313) VENV=$(NEWEST_VENV) TORCH=$(NEWEST_TORCH) \
	  bash scripts/setup.sh
	$(EXPECT_CUDA) $(NEWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider tests

bench: setup
	$(PYTHON) -m ckpt_ext.bench

bench-full: setup
	$(PYTHON) -m ckpt_ext.bench --full

bench-plan: setup
	$(PYTHON) -m ckpt_ext.bench --section plan

demo: bench

clean:
	rm -rf build *.egg-info ckpt_ext/*.so
