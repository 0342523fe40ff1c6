# The two commands of the README: `make bench` (the main job) and `make test`. Both set
# everything up first (scripts/setup.sh: venv, pinned torch, build), so they work on a fresh clone.
PYTHON := .venv/bin/python

.PHONY: setup test bench demo clean

setup:
	bash scripts/setup.sh

# Where nvcc is on PATH the build must have the CUDA kernels; CKPT_EXT_EXPECT_CUDA makes a test
# fail on a silent CPU-only build (tests/test_ops_cuda.py).
test: setup
	CKPT_EXT_EXPECT_CUDA=$$(command -v nvcc >/dev/null && [ "$${CKPT_EXT_CUDA:-auto}" != 0 ] && echo 1) \
	  $(PYTHON) -m pytest -q tests

bench: setup
	$(PYTHON) -m ckpt_ext.bench

demo: bench

clean:
	rm -rf build *.egg-info ckpt_ext/*.so
