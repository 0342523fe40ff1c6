"""One memory meter for CPU and CUDA: current and peak tensor bytes, labelled readings, and a
timeline of memory through a step.

* CPU: exact. ``ckpt_ext._C`` carries a counting wrapper around c10's CPU allocator
  (``csrc/memory.cpp``); while the meter is installed every CPU tensor storage — ATen outputs and
  temporaries, those inside our C++ kernels, Inductor buffers — is counted to the byte (the size
  asked for), and freeing it subtracts the same figure. Not counted: storages allocated before
  installation, pinned host memory, scratch that MKL/oneDNN/OpenMP allocate with their own malloc,
  tensors over foreign memory (``torch.from_numpy``). Memory the meter never handed out that
  reaches its deleter anyway goes to the wrapped allocator's deleter and is counted in
  ``_C.cpu_meter_stats()["foreign_frees"]``; the deleter never throws.
* CUDA: ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` (the caching allocator's
  figures, block sizes rounded up to 512 bytes), the allocator's trace for the timeline, and the
  device's own view through NVML (:func:`nvml_usage`, :func:`show_usage`, as in the write-up).

Usage::

    with MemoryMeter("cpu") as m:
        ...                       # build the model and input under the meter to count them too
        m.reset_peak(); m.read("before forward")
        with m.timeline():
            loss = model(x).mean(); m.read("after loss"); loss.backward()
        m.read("after backward"); m.peak(); m.last_timeline
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional, Union

import torch

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
        """Tensor bytes alive now (on CPU: of those allocated while the meter was installed)."""
        self._sync()
        if self.device.type == "cpu":
            return int(_C.cpu_meter_stats()["current"])
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        """The highest :meth:`current` since the last :meth:`reset_peak`."""
        self._sync()
        if self.device.type == "cpu":
            return int(_C.cpu_meter_stats()["peak"])
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> int:
        """Start a new peak at the current figure, and return it."""
        self._sync()
        if self.device.type == "cpu":
            return int(_C.cpu_meter_reset_peak())
        torch.cuda.reset_peak_memory_stats(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

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
        traced = _cuda_trace_start()
        try:
            yield
        finally:
            self._sync()
            tl = _cuda_trace_stop(start_bytes, start_ns, self.device) if traced else None
            if tl is None:
                inside = self.readings[first:]
                tl = Timeline([start_ns] + [r.t_ns for r in inside],
                              [start_bytes] + [r.bytes for r in inside], exact=False)
            self.last_timeline = tl


def _cuda_trace_start() -> bool:
    try:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        return True
    except Exception:  # noqa: BLE001 - private API; fall back to readings
        return False


def _cuda_trace_stop(start_bytes: int, start_ns: int, device: torch.device) -> Optional[Timeline]:
    # Rebuild the figure from the allocator's trace: +size at each alloc, -size when a free
    # completes (memory_allocated drops then too). Times come as time_us on the wall clock; they
    # are shifted to start at start_ns so CPU and CUDA timelines read alike.
    try:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        traces = snap["device_traces"][device.index]
    except Exception:  # noqa: BLE001
        return None
    tl = Timeline([start_ns], [start_bytes], exact=True)
    cur, t0 = start_bytes, None
    for i, e in enumerate(traces):
        action = e.get("action")
        if action == "alloc":
            cur += int(e["size"])
        elif action == "free_completed":
            cur -= int(e["size"])
        else:
            continue
        t_us = e.get("time_us")
        if t_us is None:
            t = start_ns + i  # no timestamps in this torch: event order only
        else:
            t0 = t_us if t0 is None else t0
            t = start_ns + int((t_us - t0) * 1000)
        tl.t_ns.append(t)
        tl.bytes.append(cur)
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
