"""What the bench records of the machine it ran on, and the read-bandwidth probe a memory-bound decode step is
measured against in the same run."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch


def machine(threads: int, device: torch.device) -> dict[str, Any]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    import platform

    info = {
        "cpu": cpu or platform.processor() or platform.machine(), "cores": os.cpu_count(), "threads": threads,
        "torch": torch.__version__, "python": platform.python_version(), "device": str(device),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_avg_before": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


READ_BYTES = 1 << 30  # what the read-bandwidth probe sums: far past any cache, as a decode step's weights are


def read_bandwidth(
    device: torch.device, nbytes: int = READ_BYTES, repeats: int = 5, clock: Callable[[], float] = time.perf_counter
) -> float:
    """GB/s (1e9 B/s) of the best of `repeats` float32 sums over `nbytes`: the rate a memory-bound decode step can
    approach on this machine now (its speed drifts, so the bench measures it before and after the sweep)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    x.sum()  # untimed: the first pass faults the pages in

    def timed() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = clock()
        x.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return clock() - t0

    return x.nbytes / min(timed() for _ in range(repeats)) / 1e9
