"""What one `static-decode bench` run measures (BenchConfig, checked when made) and the command that repeats it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from static_decode.checks import check_int
from static_decode.commands.bench_systems import SYSTEMS
from static_decode.parallel import SINGLE, TensorParallel

DEFAULT_CONTEXTS = (128, 512, 1024, 1920)  # max_len / 16 = 128 included
ATTENTION_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK = {"contexts": (128, 1024), "steps": 32, "repeats": 3, "attention_lengths": (2048, 8192, 32768)}
PROFILE_STEPS = 8


@dataclass
class BenchConfig:
    """One bench run. `settings` (a capture.CompileSettings) overrides the device default (tests: "eager")."""

    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    max_len: int = 2048
    steps: int = 64  # timed decode steps per request
    repeats: int = 7  # timed requests per (system, context)
    warmup: int = 1  # untimed requests per (system, context) first
    systems: tuple[str, ...] = SYSTEMS
    model: Path | None = None  # None: the embedded default model
    threads: int | None = None  # torch intra-op threads; None: every core
    device: str | None = None
    dtype: str | None = None
    kv_dtype: str | None = None  # static-decode's K/V cache dtype (Llama.kv_dtype); None: the model's
    quantize: str | None = None  # static-decode's weight-only quantization (static_decode.quant); None: float
    attention_lengths: tuple[int, ...] | None = ATTENTION_LENGTHS  # None: no attention rows
    transformers_compile: bool = True
    settings: Any = None
    progress: bool = True
    profile: Path | None = None  # torch.profiler Chrome trace of PROFILE_STEPS decode steps of the first system
    wait_idle: float = 0.0  # before each timed request wait up to this many s for the CPUs to be idle (shared hosts)
    tp: TensorParallel = SINGLE  # under torchrun: this rank's place (static_decode.launch)
    gguf: Path | None = None  # the llama.cpp system's model: a GGUF of the same weights (skipped without one)

    def __post_init__(self) -> None:
        for name in ("max_len", "steps", "repeats"):
            check_int(name, getattr(self, name), minimum=1)
        if self.warmup < 0 or (self.threads is not None and self.threads < 1):
            raise ValueError(f"warmup must be >= 0 and threads >= 1, got {self.warmup!r}, {self.threads!r}")
        if not self.contexts or len(set(self.contexts)) != len(self.contexts):
            raise ValueError(f"contexts must be distinct and at least one, got {self.contexts}")
        for c in self.contexts:
            if not 1 <= c <= self.max_len - self.steps - 1:
                raise ValueError(
                    f"context {c} does not fit: a request holds context + steps + 1 = {c + self.steps + 1} "
                    f"tokens, max_len is {self.max_len} (and a context needs at least 1 token)"
                )
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems or len(set(self.systems)) != len(self.systems):
            raise ValueError(f"systems must be distinct names from {', '.join(SYSTEMS)}, got {self.systems}")
        if self.gguf is not None and "llama.cpp" in self.systems and not Path(self.gguf).is_file():
            # checked here, before minutes of model loading and compiling for the systems that come first
            raise FileNotFoundError(f"--gguf {self.gguf}: no such file")

    def command(self, threads: int) -> str:
        """The command line that repeats this run (output paths left out)."""
        return command(self, threads)


def command(config: BenchConfig, threads: int) -> str:
    """The command line that repeats this run (output paths left out)."""
    launcher = f"torchrun --nproc-per-node {config.tp.world} -m static_decode" if config.tp.enabled else "static-decode"
    parts = [f"{launcher} bench", f"--contexts {','.join(map(str, config.contexts))}",
             f"--max-len {config.max_len}", f"--steps {config.steps}", f"--repeats {config.repeats}",
             f"--warmup {config.warmup}", f"--systems {','.join(config.systems)}", f"--threads {threads}"]
    parts += [f"--model {config.model}"] if config.model else []
    parts += [f"--gguf {config.gguf}"] if config.gguf else []
    parts += [f"--device {config.device}"] if config.device else []
    parts += [f"--dtype {config.dtype}"] if config.dtype else []
    parts += [f"--kv-dtype {config.kv_dtype}"] if config.kv_dtype else []
    parts += [f"--quantize {config.quantize}"] if config.quantize else []
    if config.attention_lengths is None:
        parts.append("--no-attention")
    else:
        parts.append(f"--attention-lengths {','.join(map(str, config.attention_lengths))}")
    parts += [] if config.transformers_compile else ["--no-transformers-compile"]
    parts += [f"--wait-idle {config.wait_idle:g}"] if config.wait_idle > 0 else []
    backend = getattr(config.settings, "backend", "inductor")
    parts += [] if backend == "inductor" else [f"--compile-backend {backend}"]
    return " ".join(parts)
