"""How many bytes a device can still hand out: what a large allocation (a KV cache, a model's weights) is checked
against first, so that a size the device cannot hold is one sentence in GiB rather than an allocator traceback or, on a
CPU host, the OOM killer (static_decode.generation.memory, static_decode.checkpoints.gguf_plan)."""

from __future__ import annotations

from pathlib import Path

import torch

GIB = 1024**3
MEMINFO = Path("/proc/meminfo")


def free_bytes(device: torch.device | str) -> int | None:
    """Bytes `device` can still hand out, or None when that cannot be known (then nothing is refused).

    CUDA: the driver's free memory plus what PyTorch's caching allocator holds reserved but unused (it serves
    new tensors from there first). CPU: MemAvailable of /proc/meminfo. Other device types: None.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, _total = torch.cuda.mem_get_info(index)
        return free + torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
    if device.type == "cpu":
        return _mem_available()
    return None


def gib(nbytes: int) -> str:
    """A byte count in GiB with two decimals, e.g. "12.50 GiB"."""
    return f"{nbytes / GIB:.2f} GiB"


def _mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where the file is missing or unreadable (not Linux)."""
    try:
        with MEMINFO.open() as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    value, unit = line.split()[1:3]
                    return int(value) * (1024 if unit.lower() == "kb" else 1)
    except (OSError, ValueError, IndexError):
        pass
    return None
