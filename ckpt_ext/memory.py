"""One memory meter for CPU and CUDA: current and peak tensor bytes, labelled readings, a timeline
of memory through a step, and :func:`measured_step`, one training step measured in bytes.

CPU: exact bytes of every tensor storage, counted by a wrapper around c10's allocator
(``csrc/memory.cpp``). CUDA: requested bytes (``torch.cuda.memory_stats()``
``requested_bytes.all.current``/``.peak``), the timeline from the allocator's trace. NVML's view
(:func:`nvml_usage`) imports pynvml only when called. What is and is not counted, and why:
docs/benchmark.md#the-memory-meter. Usage:
``with MemoryMeter("cpu") as m: m.reset_peak(); ...; m.read("after loss"); m.peak()``
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Union

import torch
from torch import nn

from . import _C


@dataclass
class Reading:
    label: str
    bytes: int  #: tensor bytes alive at the reading
    peak: int  #: highest figure since the last reset_peak
    t_ns: int  #: the meter's clock


@dataclass
class Timeline:
    t_ns: list[int] = field(default_factory=list)  #: event times, meter clock
    bytes: list[int] = field(default_factory=list)  #: tensor bytes alive after each event
    exact: bool = True  #: False where only labelled readings could be collected


class MemoryMeter:
    """Counts tensor memory on ``device`` ("cpu", "cuda", "cuda:1", a torch.device).

    On CPU, entering the meter installs the counting allocator (idempotent; leaving uninstalls it
    only if this meter installed it). On CUDA it needs a usable CUDA device and says so otherwise.
    """

    def __init__(self, device: Union[str, torch.device] = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"MemoryMeter supports cpu and cuda devices, got {self.device}")
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("MemoryMeter: a cuda device was asked for but "
                                   "torch.cuda.is_available() is False (no NVIDIA driver or GPU, "
                                   "or a CPU-only torch build); use device='cpu'")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        self.readings: list[Reading] = []
        self.last_timeline: Optional[Timeline] = None
        self._installed_here = False

    # -- lifetime --------------------------------------------------------------------------------
    def __enter__(self) -> "MemoryMeter":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self.device.type == "cpu":
            self._installed_here = _C.cpu_meter_install() or self._installed_here

    def stop(self) -> None:
        """On CPU: put c10's previous allocator back, at the priority the meter found in place
        (it never raises c10's allocator priority, so anything may replace the allocator again
        afterwards). Storages counted so far are still subtracted when freed."""
        if self.device.type == "cpu" and self._installed_here:
            _C.cpu_meter_uninstall()
            self._installed_here = False

    # -- figures ---------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def current(self) -> int:
        """Tensor bytes alive now (on CPU: of those allocated while the meter was installed; on
        CUDA: requested bytes)."""
        self._sync()
        if self.device.type == "cpu":
            return int(_C.cpu_meter_stats()["current"])
        return cuda_requested_bytes(self.device)[0]

    def peak(self) -> int:
        """The highest :meth:`current` since the last :meth:`reset_peak`."""
        self._sync()
        if self.device.type == "cpu":
            return int(_C.cpu_meter_stats()["peak"])
        return cuda_requested_bytes(self.device)[1]

    def reset_peak(self) -> int:
        """Start a new peak at the current figure, and return it."""
        self._sync()
        if self.device.type == "cpu":
            return int(_C.cpu_meter_reset_peak())
        torch.cuda.reset_peak_memory_stats(self.device)
        return cuda_requested_bytes(self.device)[1]

    def now_ns(self) -> int:
        return int(_C.cpu_meter_now_ns())

    def read(self, label: str) -> Reading:
        """Take a labelled reading (kept in ``self.readings``) — the write-up's ``show_usage``
        points, in exact tensor bytes."""
        r = Reading(label, self.current(), self.peak(), self.now_ns())
        self.readings.append(r)
        return r

    # -- timeline --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def timeline(self) -> Iterator[None]:
        """Record memory after every allocation and free inside the block; the result is in
        ``self.last_timeline``. On CUDA it uses the caching allocator's trace (a private PyTorch
        API); if that is unavailable, the labelled readings taken inside the block stand in."""
        if self.device.type == "cpu":
            _C.cpu_meter_record(True)
            try:
                yield
            finally:
                _C.cpu_meter_record(False)
                t, b = _C.cpu_meter_timeline()
                self.last_timeline = Timeline(list(t), list(b), exact=True)
            return
        first = len(self.readings)
        start_bytes, start_ns = self.current(), self.now_ns()
        # the trace stamps events on the wall clock, in microseconds: this maps them to the meter's
        unix_minus_meter_ns = time.time_ns() - self.now_ns()
        traced = cuda_trace_start()
        try:
            yield
        finally:
            self._sync()
            trace = cuda_trace_stop(self.device) if traced else None
            if trace is not None:
                tl = timeline_from_trace(trace, start_bytes, start_ns, self.now_ns(),
                                         unix_minus_meter_ns, end_bytes=self.current())
            else:
                inside = self.readings[first:]
                tl = Timeline([start_ns] + [r.t_ns for r in inside],
                              [start_bytes] + [r.bytes for r in inside], exact=False)
            self.last_timeline = tl


# ------------------------------------------------------------------------------------------------
# One step, measured

def clear_grads(net: nn.Module) -> None:
    """Drop every parameter's gradient, so "before forward" holds weights and input only."""
    for p in net.parameters():
        p.grad = None


def measured_step(net: Callable, x: torch.Tensor, meter: MemoryMeter, timeline: bool = False,
                  loss_fn: Optional[Callable] = None) -> dict:
    """One step (forward, ``loss_fn(out, x)``, backward; default loss ``out.mean()``) with the
    write-up's four readings, the peak and, if asked, the timeline. Clear gradients first.

    The output is dropped right after the loss, so ``kept_for_backward`` (after loss - before
    forward - the loss) is exactly what autograd keeps; ``peak_above_before_forward`` is over the
    whole step."""
    meter.readings.clear()
    r0 = meter.read("before forward")
    meter.reset_peak()
    t_ns = {}
    with meter.timeline() if timeline else contextlib.nullcontext():
        out = net(x)
        r1 = meter.read("after forward")
        loss = loss_fn(out, x) if loss_fn is not None else out.mean()
        loss_bytes = loss.numel() * loss.element_size()
        del out  # what is left is what autograd keeps for backward
        r2 = meter.read("after loss")
        t_ns["backward"] = meter.now_ns()
        loss.backward()
        r3 = meter.read("after backward")
    peak = meter.peak()
    res = {
        "readings": {r.label: r.bytes for r in (r0, r1, r2, r3)},
        "activations_after_forward": r1.bytes - r0.bytes,
        "kept_for_backward": r2.bytes - r0.bytes - loss_bytes,
        "peak": peak,
        "peak_above_before_forward": peak - r0.bytes,
        "loss": float(loss.detach().float()),
    }
    if timeline and meter.last_timeline is not None:
        tl = meter.last_timeline
        start = tl.t_ns[0]
        res["timeline"] = {
            "t_ms": [(t - start) / 1e6 for t in tl.t_ns],
            "bytes_above_before_forward": [b - r0.bytes for b in tl.bytes],
            "backward_starts_ms": (t_ns["backward"] - start) / 1e6,
            "exact": tl.exact,
        }
    return res


# ------------------------------------------------------------------------------------------------
# CUDA: requested bytes and the allocator's trace

#: Trace entries kept (a ring buffer: an overflow loses the oldest, and the timeline says so).
TRACE_MAX_ENTRIES = 1_000_000


def cuda_requested_bytes(device: Union[str, torch.device, None] = None) -> tuple[int, int]:
    """(current, peak) requested bytes of the caching allocator on ``device``: the sum of the
    sizes tensors asked for, whatever block (rounded, or a larger cached one) served them.
    Zeros before the allocator's first use."""
    stats = torch.cuda.memory_stats(device)
    return (int(stats.get("requested_bytes.all.current", 0)),
            int(stats.get("requested_bytes.all.peak", 0)))


def cuda_trace_start() -> bool:
    """Start the allocator's event history, with no stack traces, cleared of earlier entries and
    without the events the timeline does not read. False where this torch or allocator backend
    has no history (cudaMallocAsync)."""
    record = torch.cuda.memory._record_memory_history  # private API, stable since torch 2.1
    base = dict(context=None, stacks="python", max_entries=TRACE_MAX_ENTRIES)
    skip = ["free_requested", "segment_alloc", "segment_free", "snapshot"]
    # torch 2.11-2.14 take every argument; an older one only the base (its enabling clears)
    for kw in (dict(base, clear_history=True, skip_actions=skip),
               dict(base, clear_history=True), base):
        try:
            record("all", **kw)
            return True
        except Exception:  # noqa: BLE001 - private API; the readings stand in at the end
            continue
    return False


def cuda_trace_stop(device: torch.device) -> Optional[list]:
    """The trace entries recorded on ``device`` since :func:`cuda_trace_start`; history off."""
    try:
        snap = torch.cuda.memory._snapshot()
        return list(snap["device_traces"][device.index or 0])
    except Exception:  # noqa: BLE001
        return None
    finally:
        try:
            torch.cuda.memory._record_memory_history(None)
        except Exception:  # noqa: BLE001
            pass


def timeline_from_trace(trace: list, start_bytes: int, start_ns: int, end_ns: int,
                        unix_minus_meter_ns: int, end_bytes: Optional[int] = None) -> Timeline:
    """Requested bytes after every allocator event of ``trace`` (entries as in
    ``torch.cuda.memory._snapshot()["device_traces"][i]``), from ``start_bytes`` at ``start_ns``:
    +size at each ``alloc``, -size at each ``free_completed`` (the two moments the allocator's
    requested-bytes figure moves; ``free_requested`` waits for the streams that used the block,
    and segment events are cached memory, not tensors).

    Times: an event's ``time_us`` (wall clock) minus ``unix_minus_meter_ns`` is on the meter's
    clock. Should those times fall outside [start_ns, end_ns] by more than a second (a clock this
    mapping does not know), the events are shifted to start at ``start_ns`` instead; without
    timestamps they are spaced 1 ns apart. Times never go backwards. ``exact`` is False when the
    trace filled its ring buffer (the oldest events lost) or its last figure disagrees with
    ``end_bytes``, the reading taken after it."""
    events = [(e, int(e["size"]) if e.get("action") == "alloc" else -int(e["size"]))
              for e in trace if e.get("action") in ("alloc", "free_completed")]
    stamps = [e.get("time_us") for e, _ in events]
    if events and all(t is not None for t in stamps):
        times = [int(t) * 1000 - unix_minus_meter_ns for t in stamps]
        if not all(start_ns - 10**9 <= t <= end_ns + 10**9 for t in times):
            times = [start_ns + (t - times[0]) for t in times]
    else:
        times = [start_ns + i + 1 for i in range(len(events))]
    tl = Timeline([start_ns], [start_bytes], exact=len(trace) < TRACE_MAX_ENTRIES)
    cur, t_prev = start_bytes, start_ns
    for (_, delta), t in zip(events, times):
        cur += delta
        t_prev = max(t, t_prev)
        tl.t_ns.append(t_prev)
        tl.bytes.append(cur)
    if end_bytes is not None and cur != end_bytes:
        tl.exact = False
    return tl


# ------------------------------------------------------------------------------------------------
# The device's own view, as the write-up's show_usage prints it.

def nvml_usage(index: int = 0) -> dict:
    """``{"used", "free", "total"}`` bytes of GPU ``index`` as the driver reports them (all
    processes, the CUDA context and the caching allocator's reserve included).

    Raises RuntimeError with a clear message when ``nvidia-ml-py`` is missing or no NVIDIA
    driver can be reached."""
    try:
        import pynvml  # from the nvidia-ml-py package
    except ImportError as e:
        raise RuntimeError("nvml_usage needs the nvidia-ml-py package (pip install "
                           "nvidia-ml-py)") from e
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise RuntimeError(f"no NVIDIA driver reachable through NVML ({e}); device memory as the "
                           "driver sees it is only available on a machine with an NVIDIA GPU") from e
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
        return {"used": int(info.used), "free": int(info.free), "total": int(info.total)}
    finally:
        pynvml.nvmlShutdown()


def show_usage(label: str = "", index: int = 0) -> Optional[dict]:
    """Print the GPU's used/total memory as NVML reports it (the write-up's helper); on a machine
    without an NVIDIA driver, print why and return None instead of failing."""
    try:
        u = nvml_usage(index)
    except RuntimeError as e:
        print(f"{label}: {e}")
        return None
    print(f"{label}: GPU {index} used {u['used'] / 2**20:.0f} MiB of {u['total'] / 2**20:.0f} MiB")
    return u


@contextlib.contextmanager
def uninstrumented(device: torch.device):
    """Run on the stock CPU allocator: the counting wrapper adds work to every allocation and
    free, which would tax allocation-heavy modes in the timings. Tensors it counted stay counted
    (their frees are still subtracted); those allocated meanwhile are not counted at all."""
    if device.type != "cpu":
        yield
        return
    was_installed = _C.cpu_meter_uninstall()
    try:
        yield
    finally:
        if was_installed:
            _C.cpu_meter_install()
