"""What one `static-decode bench` run measures (BenchConfig, checked when made) and the command that repeats it.

Several weight forms side by side: `quantize` holds static-decode's forms ("none" = the checkpoint's dtype,
"int8", "int4", ...; static_decode.model.quant), `gguf` llama.cpp's GGUF files, each optionally NAME=PATH; every
form and file becomes systems of its own (static_decode.commands.bench.lineup).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from static_decode.base.checks import check_int, is_number
from static_decode.commands.bench.requests import request_forms
from static_decode.commands.bench.systems import SYSTEMS
from static_decode.model.parallel import SINGLE, TensorParallel
from static_decode.model.quant import LOAD_CHOICES, parse

DEFAULT_CONTEXTS = (128, 512, 1024, 1920)  # max_len / 16 = 128 included
ATTENTION_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK = {"contexts": (128, 1024), "steps": 32, "repeats": 3, "attention_lengths": (2048, 8192, 32768)}
PROFILE_STEPS = 8
NAME = re.compile(r"[A-Za-z0-9_.+-]+")  # a GGUF system's NAME= (it ends up in a table header and the JSON)


@dataclass(frozen=True)
class GGUFFile:
    """One GGUF for a llama.cpp system; `name` from NAME=PATH, None: named after the file's quant type."""

    path: Path
    name: str | None = None

    def spec(self) -> str:
        """How --gguf spells it."""
        return f"{self.name}={self.path}" if self.name else str(self.path)


def gguf_files(value: str | Path | GGUFFile | Iterable[str | Path | GGUFFile] | None) -> tuple[GGUFFile, ...]:
    """The GGUF files of --gguf: a path, "NAME=PATH", comma-separated lists of those, or a sequence of any of them
    (the option repeated). An item that is an existing file is a path even if it holds "="."""
    if value is None:
        return ()
    if isinstance(value, GGUFFile):
        return (value,)
    if isinstance(value, Path):
        return (GGUFFile(value),)
    if not isinstance(value, str):
        return tuple(f for v in value for f in gguf_files(v))
    out = []
    for item in (t.strip() for t in value.split(",")):
        if not item:
            continue
        name, eq, path = item.partition("=")
        if not eq or Path(item).is_file():
            out.append(GGUFFile(Path(item)))
        elif not NAME.fullmatch(name) or not path:
            raise ValueError(f"--gguf {item!r}: expected PATH or NAME=PATH with NAME of letters, digits, _.+-")
        else:
            out.append(GGUFFile(Path(path), name))
    return tuple(out)


GGUF_FORM = "gguf"  # --quantize's form for static-decode on each --gguf file itself (its blocks as stored)


def quantize_forms(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """static-decode's weight forms of --quantize ("int8", "none,int8,int4"): each one static_decode.model.quant takes
    or "none" (the checkpoint's dtype), lower-cased, no two the same scheme; () for None."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    forms = tuple(t.strip().lower() for t in items if t.strip())
    schemes: dict[Any, str] = {}
    for f in forms:
        if f == GGUF_FORM:
            if forms.count(f) > 1:
                raise ValueError(f"--quantize: {GGUF_FORM!r} given twice; give it once")
            continue
        try:
            scheme = parse(f)
        except ValueError as e:
            raise ValueError(f"--quantize {f!r}: choose from none, {', '.join(LOAD_CHOICES)}, {GGUF_FORM}") from e
        if scheme in schemes:
            raise ValueError(f"--quantize: {schemes[scheme]!r} and {f!r} are the same form; give it once")
        schemes[scheme] = f
    return forms


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
    # static-decode's weight forms ("int8", "none,int8,int4" or a tuple; static_decode.model.quant), a tuple once made;
    # (): the checkpoint's dtype only
    quantize: str | tuple[str, ...] | None = None
    attention_lengths: tuple[int, ...] | None = ATTENTION_LENGTHS  # None: no attention rows
    transformers_compile: bool = True
    settings: Any = None
    progress: bool = True
    profile: Path | None = None  # torch.profiler Chrome trace of PROFILE_STEPS decode steps of the first system
    wait_idle: float = 0.0  # before each timed request wait up to this many s for the CPUs to be idle (shared hosts)
    tp: TensorParallel = SINGLE  # under torchrun: this rank's place (static_decode.launch)
    # the llama.cpp systems' models: GGUFs of the same weights (gguf_files; a tuple of GGUFFile once made)
    gguf: str | Path | tuple[GGUFFile, ...] | None = None
    # the longest wait for one answer of a peer's worker process (llama.cpp: the load, a prefill, a request's
    # decode steps); past it the worker is killed and its row says it hung
    peer_timeout: float = 600.0
    # the request forms static-decode is timed with ("greedy", "logprobs", "min-p", ...; bench.requests.FORMS),
    # each its own system beside plain greedy; a tuple once made
    requests: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        self.quantize = quantize_forms(self.quantize)
        self.requests = request_forms(self.requests)
        if self.requests != ("greedy",) and "static-decode" not in self.systems:
            raise ValueError(f"--requests {','.join(self.requests)} times the static-decode system, which "
                             f"--systems {','.join(self.systems)} leaves out")
        self.gguf = gguf_files(self.gguf)
        if GGUF_FORM in self.quantize and not self.gguf:
            raise ValueError(f"--quantize {GGUF_FORM} runs static-decode on the --gguf files; none was given")
        for name in ("max_len", "steps", "repeats"):
            check_int(name, getattr(self, name), minimum=1)
        if not (is_number(self.peer_timeout) and self.peer_timeout > 0):
            raise ValueError(f"peer_timeout must be a number of seconds > 0, got {self.peer_timeout!r}")
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
        if "llama.cpp" in self.systems or GGUF_FORM in self.quantize:
            # checked here, before minutes of model loading and compiling for the systems that come first
            seen: set[Path] = set()
            for f in self.gguf:
                if not f.path.is_file():
                    raise FileNotFoundError(f"--gguf {f.path}: no such file")
                if f.path.resolve() in seen:
                    raise ValueError(f"--gguf {f.path}: given twice")
                seen.add(f.path.resolve())
            names = [f.name for f in self.gguf if f.name]
            if len(set(names)) != len(names):
                raise ValueError(f"--gguf: NAME= must differ between files, got {', '.join(names)}")

    @property
    def forms(self) -> tuple[str, ...]:
        """static-decode's weight forms, ("none",) when --quantize is not given; "gguf" becomes one form a --gguf
        file, "gguf:LABEL" (`gguf_forms`)."""
        out: list[str] = []
        for f in self.quantize or ("none",):
            out += list(self.gguf_forms()) if f == GGUF_FORM else [f]
        return tuple(out)

    def gguf_forms(self) -> dict[str, Path]:
        """"gguf:LABEL" -> its file, LABEL the file's NAME= or its name less ".gguf", for --quantize gguf."""
        if GGUF_FORM not in (self.quantize or ()):
            return {}
        return {f"gguf:{f.name or f.path.name.removesuffix('.gguf')}": f.path for f in self.gguf}

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
    parts += [f"--gguf {','.join(f.spec() for f in config.gguf)}"] if config.gguf else []
    parts += [f"--device {config.device}"] if config.device else []
    parts += [f"--dtype {config.dtype}"] if config.dtype else []
    parts += [f"--kv-dtype {config.kv_dtype}"] if config.kv_dtype else []
    parts += [f"--quantize {','.join(config.quantize)}"] if config.quantize else []
    parts += [f"--requests {','.join(config.requests)}"] if config.requests != ("greedy",) else []
    if config.attention_lengths is None:
        parts.append("--no-attention")
    else:
        parts.append(f"--attention-lengths {','.join(map(str, config.attention_lengths))}")
    parts += [] if config.transformers_compile else ["--no-transformers-compile"]
    parts += [f"--wait-idle {config.wait_idle:g}"] if config.wait_idle > 0 else []
    parts += [f"--peer-timeout {config.peer_timeout:g}"] if config.peer_timeout != 600.0 else []
    backend = getattr(config.settings, "backend", "inductor")
    parts += [] if backend == "inductor" else [f"--compile-backend {backend}"]
    return " ".join(parts)
