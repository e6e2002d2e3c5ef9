"""How a step is compiled: torch.compile arguments per device, chosen by measurement.

* CUDA: mode="reduce-overhead" — inductor kernels replayed as one CUDA graph per (kind, bucket), so a decode
  step costs one graph launch instead of hundreds of kernel launches.
* CPU: there are no CUDA graphs (reduce-overhead on CPU tensors only adds a "cudagraph skip"), so the choice
  is between inductor's Python wrapper and its C++ wrapper (`cpp_wrapper`), which drops the per-call Python
  work of calling each generated kernel. The numbers behind the default are in profiles/compile_cpu.md.

Always fullgraph=True (a graph break inside a step is a bug, not a fallback) and dynamic=False (a new read
length must be a new graph, never a dynamic-shape kernel: automatic dynamic shapes would otherwise turn the
Python int read_len symbolic after its second value).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")

# Measured on the embedded default model (profiles/compile_cpu.md): the C++ wrapper is the fastest CPU
# setting there. Override with CompileSettings(...) when your CPU model says otherwise.
CPU_OPTIONS: Mapping[str, Any] = {"cpp_wrapper": True}

# Graphs a compiled step may hold beyond its own read buckets before dynamo's recompile limit stops it. Extra
# graphs are not expected (the guards count recompiles and the tests pin them at zero); the margin keeps one
# stray guard failure from turning into a FailOnRecompileLimitHit (fullgraph) in the middle of a request.
RECOMPILE_HEADROOM = 8


def _compile_accepts(name: str) -> bool:
    """Whether this torch.compile takes keyword `name` (recompile_limit, isolate_recompiles are new)."""
    try:
        return name in inspect.signature(torch.compile).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
        return False


@dataclass(frozen=True)
class CompileSettings:
    """torch.compile arguments for the steps (torch.compile allows `mode` or `options`, not both)."""

    mode: str | None = None  # one of MODES; None = inductor's default mode
    options: Mapping[str, Any] = field(default_factory=dict)  # inductor config overrides, e.g. cpp_wrapper
    fullgraph: bool = True  # a graph break in a step is an error
    dynamic: bool = False  # one graph per read length; never symbolic shapes
    backend: str = "inductor"  # "eager"/"aot_eager": dynamo only (debugging, fast tests); no mode/options

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.options, Mapping):
            raise TypeError(
                f"options must be a mapping of inductor settings, got {type(self.options).__name__}"
            )
        if self.mode not in (None, "default") and self.options:
            raise ValueError(
                f"torch.compile takes mode or options, not both: mode={self.mode!r}, "
                f"options={dict(self.options)}"
            )
        if self.backend != "inductor" and (self.mode not in (None, "default") or self.options):
            raise ValueError(f"mode and options are inductor settings; backend={self.backend!r} takes neither")
        object.__setattr__(self, "options", dict(self.options))

    @classmethod
    def for_device(cls, device: torch.device | str, *, collectives: str | None = None) -> CompileSettings:
        """The measured default: reduce-overhead (CUDA graphs) on CUDA, the C++ wrapper on CPU.

        collectives: the torch.distributed backend the steps' all-reduces run on (tensor parallelism), or
        None. NCCL collectives can be captured in a CUDA graph; any other backend on CUDA tensors (gloo)
        runs on the host and cannot, so such steps are compiled without CUDA graphs.
        """
        device = torch.device(device)
        if device.type == "cuda":
            if collectives not in (None, "nccl"):
                return cls()
            return cls(mode="reduce-overhead")
        if device.type == "cpu":
            return cls(options=CPU_OPTIONS)
        return cls()

    def cudagraphs(self, device: torch.device | str) -> bool:
        """Whether steps compiled with these settings on `device` run as CUDA graphs."""
        on_cuda = torch.device(device).type == "cuda" and self.backend == "inductor"
        return on_cuda and (self.mode in CUDAGRAPH_MODES or bool(self.options.get("triton.cudagraphs")))

    def describe(self) -> str:
        if self.backend != "inductor":
            return f"backend={self.backend}"
        if self.options:
            return "options=" + ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"mode={self.mode or 'default'}"

    def compile(self, fn: Callable[..., Any], *, graphs: int) -> Callable[..., Any]:
        """torch.compile `fn`, allowing it `graphs` compiled graphs (its read buckets).

        Where torch supports it (2.13+), the limit (`graphs` + RECOMPILE_HEADROOM) is set on this compile and
        its graphs are isolated from other compiles of the same function (several Generators in one process do
        not share or exhaust one code cache). Older torch (2.11 on the GPU machines) has only the process-wide
        limits, shared by every compile of a function: the caller (`StepRegistry`) raises those to the graphs
        of every registry so far plus the headroom, never lowering them.
        """
        kwargs: dict[str, Any] = {"fullgraph": self.fullgraph, "dynamic": self.dynamic, "backend": self.backend}
        if self.options:
            kwargs["options"] = dict(self.options)
        elif self.mode not in (None, "default"):
            kwargs["mode"] = self.mode
        if _compile_accepts("recompile_limit") and _compile_accepts("isolate_recompiles"):
            kwargs["recompile_limit"] = int(graphs) + RECOMPILE_HEADROOM
            kwargs["isolate_recompiles"] = True
        return torch.compile(fn, **kwargs)


WARM_UP = ("all", "lazy")


@dataclass(frozen=True)
class CaptureOptions:
    """What `Generator(compile=True, capture=...)` compiles and when.

    The cost of "all": kinds x buckets compiles before the first request (tens of seconds each for a large
    model); the gain: no compile ever lands in the middle of a request. Restrict `kinds` to those you use
    (e.g. the greedy ones) to capture fewer graphs; the others still compile lazily if a request needs them.
    """

    buckets: Any = None  # BucketLadder, a list of read lengths ending at max_len, or None: the default ladder
    settings: CompileSettings | None = None  # None: CompileSettings.for_device(the model's device)
    warm_up: str = "all"  # "all": every (kind, bucket) when the cache is allocated; "lazy": at first use
    kinds: tuple[str, ...] | None = None  # kinds to warm up (None: all of them)
    progress: bool = True  # a progress bar and the total capture time on stderr during warm-up
    fallback: bool | None = None  # a kind that fails to compile runs eagerly; None: only for a tensor-parallel model

    def __post_init__(self) -> None:
        if self.warm_up not in WARM_UP:
            raise ValueError(f"warm_up must be one of {WARM_UP}, got {self.warm_up!r}")
        if self.fallback is not None and not isinstance(self.fallback, bool):
            raise TypeError(f"fallback must be a bool or None, got {self.fallback!r}")
        if self.settings is not None and not isinstance(self.settings, CompileSettings):
            raise TypeError(f"settings must be a CompileSettings, got {type(self.settings).__name__}")
        if self.kinds is not None:
            if isinstance(self.kinds, str) or not all(isinstance(k, str) for k in self.kinds):
                raise TypeError(f"kinds must be a tuple of step kind names, got {self.kinds!r}")
            object.__setattr__(self, "kinds", tuple(self.kinds))
