"""The meter's machinery (ckpt_ext.memory).

CPU: the counting allocator (csrc/memory.cpp) is safe to use: its deleter never throws (a throw
there is std::terminate), and after stop() c10's CPU allocator can be replaced again at the default
priority. c10's allocator priority is process-wide and can only go up, so each of these cases runs
in a fresh interpreter: the state it checks cannot have been changed by another test.

CUDA: readings and timeline in requested bytes. The pure parts (the trace-to-timeline function,
the history's settings, the statistic read) are checked here on any machine with stand-ins for
torch.cuda; the `cuda` tests check the same on a GPU, against blocks cached by earlier code.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ckpt_ext import memory
from ckpt_ext.memory import MemoryMeter, timeline_from_trace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_allocator_replaceable_after_stop():
    proc = _run("""
        import torch
        from ckpt_ext import _C
        from ckpt_ext.memory import MemoryMeter
        assert _C._cpu_allocator_replaceable(), "c10 refuses priority 0 before we start"
        for _ in range(2):
            with MemoryMeter("cpu") as m:
                x = torch.empty(1000)
                assert m.current() >= 4000
                # while installed, the meter is c10's allocator
                assert _C.cpu_meter_installed()
            assert not _C.cpu_meter_installed()
            # installed at the priority in place (0), not raised: replaceable again
            assert _C.cpu_meter_priority() == 0, _C.cpu_meter_priority()
            assert _C._cpu_allocator_replaceable()
            del x  # counted block freed after stop: still subtracted
        assert _C.cpu_meter_stats()["current"] == 0, _C.cpu_meter_stats()
        print("OK")
    """)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr


def test_foreign_free_does_not_terminate():
    """A block raw-allocated from c10's default allocator and freed through the meter (the
    allocator in place at the time of the free) reaches the meter's deleter with a pointer it
    never handed out. A throwing assert there would abort the process (std::terminate)."""
    proc = _run("""
        import torch
        from ckpt_ext import _C
        from ckpt_ext.memory import MemoryMeter
        with MemoryMeter("cpu") as m:
            before = _C.cpu_meter_stats()
            for _ in range(3):
                _C._cpu_meter_free_foreign(1 << 20)
            after = _C.cpu_meter_stats()
            x = torch.ones(10)  # the meter still counts normally
            assert m.current() == before["current"] + 40, (m.current(), before)
        assert after["foreign_frees"] == before["foreign_frees"] + 3, after
        assert after["current"] == before["current"], after  # not counted as bytes
        _C._cpu_meter_free_foreign(64)  # meter not installed: c10's own free, nothing counted
        assert _C.cpu_meter_stats()["foreign_frees"] == after["foreign_frees"]
        print("OK")
    """)
    assert proc.returncode == 0, f"exit {proc.returncode} (-6 = abort): {proc.stderr[-2000:]}"
    assert proc.stdout.strip().endswith("OK")


# ------------------------------------------------------------------------------------------------
# CUDA, on any machine: the trace-to-timeline function and the calls into torch.cuda

def _ev(action, size, time_us=None):
    e = {"action": action, "addr": 0x7F0000, "size": size, "stream": 0, "frames": []}
    if time_us is not None:
        e["time_us"] = time_us
    return e


def test_timeline_counts_alloc_and_free_completed_only():
    # wall clock 1_000_000 us = meter 5_000_000 ns: unix_minus_meter = 1e12 - 5e6 ns
    off = 1_000_000 * 1000 - 5_000_000
    trace = [_ev("segment_alloc", 2 << 20, 1_000_001), _ev("alloc", 1000, 1_000_001),
             _ev("alloc", 24, 1_000_002), _ev("free_requested", 1000, 1_000_003),
             _ev("free_completed", 1000, 1_000_004), _ev("segment_free", 2 << 20, 1_000_005),
             _ev("snapshot", 0, 1_000_006)]
    tl = timeline_from_trace(trace, start_bytes=512, start_ns=5_000_000, end_ns=5_010_000,
                             unix_minus_meter_ns=off, end_bytes=536)
    assert tl.bytes == [512, 1512, 1536, 536]
    assert tl.t_ns == [5_000_000, 5_001_000, 5_002_000, 5_004_000]
    assert tl.exact


def test_timeline_flags_a_trace_that_disagrees_or_overflowed(monkeypatch):
    trace = [_ev("alloc", 64, 10), _ev("free_completed", 64, 11)]
    kw = dict(start_bytes=0, start_ns=0, end_ns=10**6, unix_minus_meter_ns=10_000)
    assert timeline_from_trace(trace, end_bytes=0, **kw).exact
    assert not timeline_from_trace(trace, end_bytes=64, **kw).exact  # an event missing
    monkeypatch.setattr(memory, "TRACE_MAX_ENTRIES", 2)
    assert not timeline_from_trace(trace, end_bytes=0, **kw).exact  # ring buffer full


def test_timeline_times_fall_back_to_order_and_never_go_back():
    # no timestamps: 1 ns apart from the start
    tl = timeline_from_trace([_ev("alloc", 8), _ev("alloc", 8)], 0, 100, 200, 0)
    assert tl.t_ns == [100, 101, 102] and tl.bytes == [0, 8, 16]
    # timestamps on a clock the mapping does not know (far outside the block): shifted to start
    tl = timeline_from_trace([_ev("alloc", 8, 7), _ev("alloc", 8, 9)], 0, 10**12, 10**12 + 10**6, 0)
    assert tl.t_ns == [10**12, 10**12, 10**12 + 2000]
    # a stamp a little before the start (clock jitter) is held at the start, and order kept
    tl = timeline_from_trace([_ev("alloc", 8, 0), _ev("alloc", 8, 5), _ev("alloc", 8, 3)],
                             0, 1000, 10**6, 0)
    assert tl.t_ns == [1000, 1000, 5000, 5000]


def test_history_is_recorded_without_stacks(monkeypatch):
    calls = []

    def record(enabled="all", context="all", stacks="all", max_entries=0, device=None,
               clear_history=False, skip_actions=None):
        calls.append(dict(enabled=enabled, context=context, stacks=stacks,
                          clear_history=clear_history, skip_actions=skip_actions))
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    assert memory.cuda_trace_start()
    (kw,) = calls
    assert kw["enabled"] == "all" and kw["context"] is None and kw["stacks"] == "python"
    assert kw["clear_history"]
    # the timeline reads alloc and free_completed only: those are never skipped
    assert {"alloc", "free_completed"}.isdisjoint(kw["skip_actions"])

    def record_old(enabled="all", context="all", stacks="all", max_entries=0, device=None):
        calls.append((enabled, context, stacks))
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record_old)
    calls.clear()
    assert memory.cuda_trace_start()  # a torch without clear_history and skip_actions
    assert calls == [("all", None, "python")]

    def record_none(*args, **kwargs):
        raise RuntimeError("not supported by this allocator backend")
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record_none)
    assert not memory.cuda_trace_start()  # the readings stand in


def test_cuda_figures_are_requested_bytes(monkeypatch):
    stats = {"requested_bytes.all.current": 1000003, "requested_bytes.all.peak": 2000003,
             "allocated_bytes.all.current": 1000448, "allocated_bytes.all.peak": 2000896}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: stats)
    assert memory.cuda_requested_bytes("cuda:0") == (1000003, 2000003)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})  # allocator unused
    assert memory.cuda_requested_bytes("cuda:0") == (0, 0)


class _FakeAllocator:
    """torch.cuda's figures and history for MemoryMeter("cuda") without a GPU: requested bytes
    (current, peak) and a trace of alloc/free_completed entries, stamped on the wall clock."""

    def __init__(self, monkeypatch):
        self.current, self.peak, self.trace, self.recording = 0, 0, [], False
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "memory_stats", lambda device=None: {
            "requested_bytes.all.current": self.current, "requested_bytes.all.peak": self.peak})
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self._reset_peak)
        monkeypatch.setattr(cuda.memory, "_record_memory_history", self._record)
        monkeypatch.setattr(cuda.memory, "_snapshot",
                            lambda device=None: {"segments": [], "device_traces": [self.trace]})

    def _reset_peak(self, device=None):
        self.peak = self.current

    def _record(self, enabled="all", **kw):
        self.recording = enabled is not None
        self.trace = [] if kw.get("clear_history") or enabled is None else self.trace

    def event(self, action, size):
        self.current += size if action == "alloc" else -size
        self.peak = max(self.peak, self.current)
        if self.recording:
            self.trace.append({"action": action, "size": size, "time_us": time.time_ns() // 1000})


def test_cuda_meter_wiring_without_a_gpu(monkeypatch):
    """MemoryMeter("cuda") end to end on stand-ins: readings, peak and timeline in one unit, the
    history started and stopped, event times on the meter's clock."""
    fake = _FakeAllocator(monkeypatch)
    fake.event("alloc", 1000)  # held before the meter starts
    with MemoryMeter("cuda") as m:
        assert m.device == torch.device("cuda", 0)
        base = m.current()
        assert base == 1000 and m.reset_peak() == 1000
        with m.timeline():
            assert fake.recording
            fake.event("alloc", 513)
            r1 = m.read("a")
            fake.event("alloc", 7)
            fake.event("free_completed", 513)
            r2 = m.read("b")
        assert not fake.recording
        assert (r1.bytes, r2.bytes, m.peak()) == (1513, 1007, 1520)
        tl = m.last_timeline
        assert tl.exact and tl.bytes == [1000, 1513, 1520, 1007]
        assert tl.t_ns == sorted(tl.t_ns) and tl.t_ns[0] <= r1.t_ns <= tl.t_ns[2] + 10**7
        assert tl.t_ns[-1] <= r2.t_ns + 10**7


# ------------------------------------------------------------------------------------------------
# CUDA, on a GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _fill_cache():
    """Leave the caching allocator holding free blocks of odd sizes, as earlier tests do."""
    xs = [torch.empty(n, dtype=torch.uint8, device="cuda")
          for n in (3 << 20, (5 << 20) + 123, 700_001, 4096, 511)]
    del xs


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("cached", [False, True], ids=["empty-cache", "cached-blocks"])
def test_cuda_meter_counts_requested_bytes(cached):
    """Readings, peak and timeline in one unit, relative to a baseline, whatever free blocks the
    cache holds (a block handed out whole or rounded would show in allocated bytes)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if cached:
        _fill_cache()
    sizes = (1_000_003, 4 << 20, 513)  # odd sizes: block rounding would show
    with MemoryMeter("cuda") as m:
        base = m.current()
        assert m.reset_peak() == base
        with m.timeline():
            a = torch.empty(sizes[0], dtype=torch.uint8, device="cuda")
            r1 = m.read("a")
            b = torch.empty(sizes[1], dtype=torch.uint8, device="cuda")
            r2 = m.read("a, b")
            del a
            c = torch.empty(sizes[2], dtype=torch.uint8, device="cuda")
            r3 = m.read("b, c")
            del b, c
        assert (r1.bytes - base, r2.bytes - base, r3.bytes - base) == (
            sizes[0], sizes[0] + sizes[1], sizes[1] + sizes[2])
        assert m.peak() - base == sizes[0] + sizes[1]
        assert m.current() == base
        tl = m.last_timeline
        assert tl.exact, "the trace's last figure disagrees with the reading after it"
        above = [x - base for x in tl.bytes]
        # one unit: every reading is a point of the timeline, and the peaks agree
        assert above == [0, sizes[0], sizes[0] + sizes[1], sizes[1], sizes[1] + sizes[2],
                         sizes[2], 0]
        assert max(above) == m.peak() - base
        assert tl.t_ns == sorted(tl.t_ns)
        assert tl.t_ns[0] <= r1.t_ns <= r3.t_ns <= tl.t_ns[-1] + 10**7


@pytest.mark.cuda
@needs_cuda
def test_cuda_history_has_no_stacks():
    with MemoryMeter("cuda") as m:
        with m.timeline():
            x = torch.empty(1 << 16, device="cuda")
            snap = torch.cuda.memory._snapshot()
            del x
    trace = snap["device_traces"][m.device.index]
    allocs = [e for e in trace if e["action"] == "alloc"]
    assert allocs and all(not e.get("frames") for e in allocs), allocs[:2]
    assert all("time_us" in e for e in allocs)
