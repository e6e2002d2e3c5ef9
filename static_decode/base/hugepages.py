"""Transparent huge pages for what a CPU decode step streams: `to_huge_pages(module)` (a model's weights, a KV cache).

Why: a decode step streams every weight once per token, and at long contexts the whole live KV cache; on 4 KB pages
the prefetchers stop at every page and the TLB misses. `to_huge_pages` moves a module's CPU parameters and buffers
into one mapping advised MADV_HUGEPAGE before anything touches it, each tensor swapped in place (tied weights stay
tied, memory does not double). Where the kernel could not find free 2 MB blocks while the copy faulted the mapping in
(a process that already holds several large models, beside other processes' files in the page cache), the weights
came out partly on 4 KB pages and their steps ran slower: the heap's free memory is handed back to the system first
and the mapping collapsed into huge pages after the copy (MADV_COLLAPSE, Linux 6.1+), both best effort;
`huge_page_share` reads what the kernel gave.
Elsewhere (another OS, THP off, under 2 MB in all) it does nothing and returns 0. Details:
docs/internals.md#hugepages.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20  # the x86-64 / arm64 transparent huge page
MADV_COLLAPSE = 25  # Linux's madvise advice (6.1+): make a range huge pages now, compacting as needed
ALIGN = 64  # each tensor's slot starts on a cache line
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None where there is none."""
    try:
        text = path.read_text()
    except OSError:
        return None
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else None


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _movable(model: nn.Module) -> list[torch.Tensor]:
    """The model's CPU parameters and buffers, each tensor object once (tied weights are one object)."""
    seen: set[int] = set()
    out = []
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen or t.device.type != "cpu" or t.numel() == 0 or t.is_sparse or not t.is_contiguous():
            continue
        seen.add(id(t))
        out.append(t)
    return out


def drop_file_cache(files: Iterable[str | os.PathLike[str]]) -> None:
    """Let the kernel drop the page cache of `files` (posix_fadvise DONTNEED; pages still mapped stay): checkpoint
    files read once, released before their weights' huge-page copy is faulted in: a page cache full of a large
    checkpoint left too few free 2 MB blocks for the weights of the models loaded after it, which then ran slower
    (profiles/RESULTS.md). Files that cannot be opened are passed over."""
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):  # a platform without it
            pass
        finally:
            os.close(fd)


def trim_heap() -> None:
    """glibc's malloc_trim(0): the heap's free pages back to the system (the float weights a quantized load freed
    stay in the heap otherwise, gigabytes the huge pages of the next mapping could use). Elsewhere: nothing."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def collapse(region: mmap.mmap, start: int, length: int) -> None:
    """Bytes [start, start + length) of `region` (2 MB aligned) as huge pages now, those faulted in 4 KB pages
    copied over (MADV_COLLAPSE). EAGAIN (a page busy for a moment, e.g. still in a CPU's LRU batch) is tried again,
    twice; a kernel without it (EINVAL), or no 2 MB blocks to be had (ENOMEM): left as they are."""
    for _ in range(3):
        try:
            region.madvise(MADV_COLLAPSE, start, length)
            return
        except OSError as e:
            if e.errno != errno.EAGAIN:
                return


def huge_page_share(address: int, smaps: Path = Path("/proc/self/smaps")) -> float | None:
    """The share of the resident memory of the mapping holding `address` that sits on transparent huge pages
    (AnonHugePages / Rss in the kernel's smaps; where the kernel merged it with a neighbour advised alike, theirs
    together), None where that cannot be read (not Linux, no such mapping)."""
    fields: dict[str, int] = {}
    try:
        with open(smaps) as f:
            inside = False
            for line in f:
                first = line.split(maxsplit=1)[0]
                if not first.endswith(":"):  # a mapping's header line: start-end perms offset ...
                    if inside:
                        break
                    start, _, end = first.partition("-")
                    inside = int(start, 16) <= address < int(end, 16)
                elif inside and first in ("Rss:", "AnonHugePages:"):
                    fields[first[:-1]] = int(line.split()[1])
    except (OSError, ValueError):
        return None
    if "Rss" not in fields:
        return None
    return fields.get("AnonHugePages", 0) / fields["Rss"] if fields["Rss"] else 0.0


def to_huge_pages(model: nn.Module, *, min_bytes: int = HUGE_PAGE,
                  files: Iterable[str | os.PathLike[str]] = ()) -> int:
    """Move `model`'s CPU parameters and buffers onto memory advised for transparent huge pages, in place; returns
    the bytes moved (0: nothing done, see the module's text). Values, dtypes, shapes and tying are unchanged.
    `files`: the checkpoint files the model was read from, their page cache dropped first (drop_file_cache)."""
    if sys.platform != "linux" or thp_mode() not in ("always", "madvise"):
        return 0
    tensors = _movable(model)
    total = sum(_round_up(t.nbytes, ALIGN) for t in tensors)
    if total < min_bytes:
        return 0
    drop_file_cache(files)
    trim_heap()
    # A fresh private anonymous mapping (nothing in it touched yet; torch's allocator may hand back heap memory
    # already faulted in 4 KB pages), one huge page larger than the aligned span it advises. The tensors keep it
    # alive (torch.frombuffer holds a reference to it).
    span = _round_up(total, HUGE_PAGE)
    region = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: not shmem
    base = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    start = _round_up(base, HUGE_PAGE) - base
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, span)
    except (AttributeError, OSError):  # a Python or kernel without it
        return 0
    offset = start
    with torch.no_grad():
        for t in tensors:
            # Each tensor a storage of its own over its slot, in its own dtype: one storage shared by several
            # tensors (or a byte view of one) would make a compiled step that writes a KV cache's K, V and lengths
            # see aliased inputs of different dtypes, which aot_autograd refuses.
            slot = torch.frombuffer(region, dtype=t.dtype, count=t.numel(), offset=offset).view(t.shape)
            slot.copy_(t)
            t.data = slot
            offset += _round_up(t.nbytes, ALIGN)
    trim_heap()  # the tensors' old storage, freed by the moves, back to the system
    collapse(region, start, span)  # the parts the faults left on 4 KB pages
    return total
