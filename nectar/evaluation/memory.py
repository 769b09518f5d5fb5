"""Peak memory of a block of work, on CUDA or on the CPU.

CUDA: ``torch.cuda.max_memory_allocated`` after resetting the peak — the allocator's own count, so
it includes the weights and whatever the block keeps resident (the document KV, the module).

CPU: tensors live outside Python's allocator (tracemalloc does not see them), so we read the
process's peak resident set size: on Linux the peak (VmHWM) is reset by writing "5" to
/proc/self/clear_refs and read back from /proc/self/status; freed heap is handed back first
(malloc_trim) so memory freed by an earlier block is not silently reused and under-counted.
Elsewhere we fall back to ru_maxrss, which cannot be reset (monotone; the method says so).
Both CPU figures are whole-process (weights, interpreter and libraries included): compare systems
measured in the same process, not absolute numbers across machines.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import resource
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class PeakMemory:
    peak_bytes: int = 0
    method: str = ""


def _trim_heap() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _read_hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def track_peak_memory(device: torch.device | str) -> Iterator[PeakMemory]:
    """``with track_peak_memory(dev) as pm: ...`` then read ``pm.peak_bytes`` and ``pm.method``."""
    device = torch.device(device)
    result = PeakMemory()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            yield result
        finally:
            torch.cuda.synchronize(device)
            result.peak_bytes = int(torch.cuda.max_memory_allocated(device))
            result.method = "torch.cuda.max_memory_allocated"
        return
    _trim_heap()
    resettable = os.path.exists("/proc/self/clear_refs") and _reset_hwm()
    try:
        yield result
    finally:
        hwm = _read_hwm() if resettable else None
        if hwm is not None:
            result.peak_bytes, result.method = hwm, "peak RSS (VmHWM, reset per block)"
        else:
            result.peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            result.method = "ru_maxrss (process lifetime peak; not resettable here)"
