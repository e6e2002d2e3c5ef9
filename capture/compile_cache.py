"""A persistent compile cache: a directory holding what a new process needs to skip compiling the steps.

`CaptureOptions(compile_cache=DIR)`: every compile of the steps runs with inductor's on-disk caches in DIR/inductor
(and, on CUDA, Triton's in DIR/triton plus torch's portable cache artifacts in DIR/artifacts.bin), so a new process
only re-traces. On the CPU the directory alone carries the compiled C++ kernels (the artifacts do not). The
directory switch is process-wide only while a step compiles. Why per device: docs/internals.md#compile-cache.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from capture import _dynamo_counters as dc

ARTIFACTS = "artifacts.bin"
_LOADED: set[Path] = set()  # artifact files already loaded in this process (loading twice only costs time)


def cache_counts() -> dict[str, int]:
    """Inductor's on-disk cache lookups so far in this process (FX graph and AOTAutograd caches, hits and misses):
    take the difference around a warm-up to see what a compile cache saved."""
    return dc.cache_counts()


def artifacts_carry_kernels(device: torch.device | str) -> bool:
    """Whether torch's portable cache artifacts carry the compiled kernels on `device` (Triton on CUDA: yes; the
    C++ kernels on the CPU: no, measured), i.e. whether saving and loading them is worth it there."""
    return torch.device(device).type == "cuda"


class CompileCache:
    """Compile inside `active()` with inductor's caches in `directory`; save/load the artifacts where they pay."""

    def __init__(self, directory: str | os.PathLike[str], device: torch.device | str) -> None:
        self.directory = Path(directory).expanduser()
        self.device = torch.device(device)
        self.artifacts = artifacts_carry_kernels(self.device)

    @property
    def inductor_dir(self) -> Path:
        return self.directory / "inductor"

    @property
    def triton_dir(self) -> Path | None:
        return self.directory / "triton" if self.device.type == "cuda" else None

    @property
    def artifacts_path(self) -> Path:
        return self.directory / ARTIFACTS

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Compiles inside the block read and write this directory's caches."""
        with dc.inductor_cache_dir(self.inductor_dir, self.triton_dir):
            yield

    def load(self) -> bool:
        """Load the saved artifacts (CUDA) into this directory's caches, once per process; whether it did."""
        path = self.artifacts_path.resolve()
        if not self.artifacts or path in _LOADED or not path.is_file():
            return False
        with self.active():
            torch.compiler.load_cache_artifacts(path.read_bytes())
        _LOADED.add(path)
        return True

    def save(self) -> bool:
        """Write this process's cache artifacts (CUDA) to DIR/artifacts.bin, atomically; whether it wrote any."""
        if not self.artifacts:
            return False
        saved = torch.compiler.save_cache_artifacts()
        if not saved or not saved[0]:
            return False
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=ARTIFACTS, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(saved[0])
        os.replace(tmp, self.artifacts_path)  # a reader never sees half a file
        _LOADED.add(self.artifacts_path.resolve())  # what we wrote is what this process holds
        return True
