"""A persistent compile cache: a directory holding what a new process needs to skip compiling the steps.

`CaptureOptions(compile_cache=DIR)` (and `capture-report --compile-cache DIR`): every compile of the steps runs
with inductor's on-disk caches in DIR, in preference to whatever inductor cache the environment names
(TORCHINDUCTOR_CACHE_DIR or the default /tmp/torchinductor_<user>). A new process with the same DIR then finds
the AOTAutograd and FX graph cache entries and the compiled kernels there: dynamo still traces each step (it
caches nothing across processes), but lowering and code generation, the C++ or Triton compiles, are skipped.

What carries the compiled code, per device (chosen by measurement, profiles/RESULTS.md, "Symbolic read length"):

* CPU: the directory itself. `torch.compiler.save_cache_artifacts()` / `load_cache_artifacts()` alone do not carry
  the compiled C++ kernels there (measured on a small function: a fresh process that loaded the artifacts still
  took 6.4 s against 7.6 s cold, while a new process reusing the same inductor cache directory took 1.7 s), so on
  the CPU nothing else is written.
* CUDA: the directory (inductor's caches, and Triton's in DIR/triton rather than TRITON_CACHE_DIR), and in
  addition the portable cache artifacts of this process (`torch.compiler.save_cache_artifacts()`, which do carry
  the Triton kernels) in DIR/artifacts.bin: saved after each warm-up and each lazy compile, loaded into DIR
  before the first compile of a process. Not measured on a GPU yet.

Layout: DIR/inductor (inductor's cache directory), DIR/triton (CUDA), DIR/artifacts.bin (CUDA). The directory is
created on first use. The switch of inductor's cache directory is process-wide while a step compiles (an
environment variable: see `capture._dynamo_counters.inductor_cache_dir`) and restored afterwards, so compiles
outside the steps (your own torch.compile calls) keep using the environment's cache.
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
