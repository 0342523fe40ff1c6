"""The counting CPU allocator (csrc/memory.cpp, ckpt_ext.memory.MemoryMeter) is safe to use:
its deleter never throws (a throw there is std::terminate), and after stop() c10's CPU allocator
can be replaced again at the default priority.

c10's allocator priority is process-wide and can only go up, so each case runs in a fresh
interpreter: the state it checks cannot have been changed by another test.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    never handed out. Before the fix that was a throwing assert inside a deleter: abort."""
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
