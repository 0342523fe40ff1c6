"""Suite-wide set-up: devices and the `cuda` marker, CPU ISA levels (`level`), per-test seeds,
poisoned buffers.

Devices. Tests that take the `device` fixture run on the CPU always and on CUDA where a GPU is
visible and ckpt_ext was built with CUDA kernels. Every GPU test carries the `cuda` marker (the
device fixture's "cuda" parameter adds it; CUDA-only tests write @pytest.mark.cuda), so
`pytest -m cuda` selects exactly the GPU tests and `pytest -m "not cuda"` the rest. Where no GPU
can run them they are skipped with the reason (reference.requires_gpu; the device fixture adds it),
never silently passed. The marker alone does not skip: a cuda-marked check that runs on any
machine (test_ops_cuda.py's build facts) still runs in CPU CI.

Seeds. Every test starts from torch.manual_seed(seed), and tests that draw inputs take the `seed`
fixture for their own generator. The seed is derived from the test's id (file::name[params]), so
each test sees the same inputs on every run and machine, plus an offset from the environment
variable CKPT_EXT_TEST_SEED (default 0) to draw other inputs. A failing test prints its seed and
the command that reproduces it. `--seed-sweep=START:STOP` runs the body of every test that takes
`seed` once per offset in range(START, STOP), in a loop inside one process (no per-run pytest
overhead): the flakiness check (docs/testing.md). CKPT_EXT_MEASURE=<file> writes the largest
error of each kind seen in the run (tests/reference.py: measured) to that file as JSON."""
from __future__ import annotations

import os
import zlib

import pytest
import torch

import ckpt_ext

SEED_ENV = "CKPT_EXT_TEST_SEED"
_SEED_KEY = pytest.StashKey[tuple]()
_SWEEP_RUNS = pytest.StashKey[list]()


# ------------------------------------------------------------------------------------------------
# devices and the cuda marker

from reference import requires_gpu  # noqa: E402  (defined once, in reference.py)

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, requires_gpu])]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests (``pytestmark = pytest.mark.usefixtures(
    "one_thread")``): transformers' eager experts loop calls index_add_ once per expert, tens of
    milliseconds on two CPU threads against microseconds on one, and tiny trainers' steps are
    faster too; no result depends on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=list(ckpt_ext._C._cpu_capabilities()))
def level(request):
    """Each CPU ISA level this machine can run (ckpt_ext._C._set_cpu_capability switches it in
    this process), put back after the test."""
    before = ckpt_ext._C._cpu_capability()
    ckpt_ext._C._set_cpu_capability(request.param)
    try:
        yield request.param
    finally:
        ckpt_ext._C._set_cpu_capability(before)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: needs a visible GPU and a CUDA build of ckpt_ext (select with -m cuda; "
                   "skipped with the reason elsewhere)")


def pytest_addoption(parser):
    parser.addoption(
        "--seed-sweep", default=None, metavar="START:STOP",
        help="run the body of every test that takes the `seed` fixture once per seed offset in "
             "range(START, STOP), in a loop inside this one process (the flakiness check)")


# ------------------------------------------------------------------------------------------------
# seeds

def _test_key(item) -> str:
    """file::name[params]: the same whatever the directory pytest runs from."""
    return f"{item.path.name}::{item.name}"


def seed_for(key: str, offset: int) -> int:
    return (zlib.crc32(key.encode()) + offset) % 2**31


@pytest.fixture
def seed_offset():
    return int(os.environ.get(SEED_ENV, "0"))


@pytest.fixture
def seed(request, seed_offset):
    key = _test_key(request.node)
    value = seed_for(key, seed_offset)
    request.node.stash[_SEED_KEY] = (value, seed_offset, key)
    return value


@pytest.fixture(autouse=True)
def _seed_torch(seed):
    # Any draw from torch's global generator (a test's own randn, a module's init) is the same on
    # every run of this test.
    torch.manual_seed(seed)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """--seed-sweep: call the test body once per offset, each with its own seed (and torch's
    global generator reseeded), in this process; fail with every offset that failed."""
    sweep = pyfuncitem.config.getoption("--seed-sweep")
    if not sweep or "seed" not in pyfuncitem._fixtureinfo.argnames:
        return None
    start, stop = (int(v) for v in sweep.split(":"))
    key = _test_key(pyfuncitem)
    base = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    failed = []
    for offset in range(start, stop):
        value = seed_for(key, offset)
        torch.manual_seed(value)
        try:
            pyfuncitem.obj(**dict(base, seed=value))
        except Exception as e:  # noqa: BLE001  (every failure is collected and reported below)
            failed.append((offset, value, f"{type(e).__name__}: {str(e)[:300]}"))
    pyfuncitem.config.stash.setdefault(_SWEEP_RUNS, []).append((key, stop - start, len(failed)))
    if failed:
        lines = [f"  offset {o} (seed {v}): {msg}" for o, v, msg in failed[:5]]
        raise AssertionError(
            f"{len(failed)} of {stop - start} seed offsets fail; reproduce one with "
            f"{SEED_ENV}=<offset> python -m pytest '{pyfuncitem.nodeid}'\n" + "\n".join(lines))
    return True


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    runs = config.stash.get(_SWEEP_RUNS, None)
    if runs:
        total = sum(n for _, n, _ in runs)
        bad = sum(f for _, _, f in runs)
        terminalreporter.write_line(
            f"seed sweep {config.getoption('--seed-sweep')}: {len(runs)} random tests, {total} "
            f"runs, {bad} failed runs")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and _SEED_KEY in item.stash:
        value, offset, key = item.stash[_SEED_KEY]
        report.sections.append((
            "seed", f"seed {value} = crc32({key!r}) + offset {offset}; reproduce with\n"
                    f"  {SEED_ENV}={offset} python -m pytest '{item.nodeid}'"))
    return report


def pytest_sessionfinish(session, exitstatus):
    # The measured maxima behind the bounds' comments (tests/reference.py: measured()).
    path = os.environ.get("CKPT_EXT_MEASURE")
    if path:
        import json

        from reference import MAXIMA
        with open(path, "w") as f:
            json.dump(dict(sorted(MAXIMA.items())), f, indent=1)


# ------------------------------------------------------------------------------------------------
# buffers

@pytest.fixture
def poison():
    """Every buffer the ops allocate starts as NaN, so unwritten elements fail the comparison."""
    ckpt_ext._C._set_poison_buffers(True)
    try:
        yield
    finally:
        ckpt_ext._C._set_poison_buffers(False)
