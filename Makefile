# The two commands of the README: `make bench` (the main job) and `make test`. Both set
# everything up first (scripts/setup.sh: venv, pinned torch, build), so they work on a fresh clone.
PYTHON := .venv/bin/python

.PHONY: setup test bench demo clean

setup:
	bash scripts/setup.sh

test: setup
	$(PYTHON) -m pytest -q tests

bench: setup
	$(PYTHON) -m ckpt_ext.bench

demo: bench

clean:
	rm -rf build *.egg-info ckpt_ext/*.so
