"""How a step is compiled: torch.compile arguments per device, chosen by measurement.

* CUDA: mode="reduce-overhead" — inductor kernels replayed as one CUDA graph per (kind, bucket), so a decode
  step costs one graph launch instead of hundreds of kernel launches.
* CPU: there are no CUDA graphs (reduce-overhead on CPU tensors only adds a "cudagraph skip"), so the choice
  is between inductor's Python wrapper and its C++ wrapper (`cpp_wrapper`), which drops the per-call Python
  work of calling each generated kernel. The numbers behind the default are in profiles/compile_cpu.md.

The read length (`symbolic_read_len`): a step reads the cache up to a Python int, always a rung of the bucket
ladder. Static (False), each rung is its own inductor compile: kinds x buckets compiles, each specialised to its
length. Symbolic (True), the read length is a symbol in the generated code (torch's DynamicInt, see
`capture._dynamo_counters.dynamic_int`): one compile per kind covers every rung, and under reduce-overhead
cudagraph trees still record one CUDA graph per rung from that code (a CUDA graph has fixed shapes).

* CPU default: symbolic. Measured on the embedded model at max_len 2048 (README "Compiled steps"): capture
  compiles 5 graphs instead of 17 (152 s instead of 631 s cold on the 2-vCPU machine), and a token costs 1-5% more
  (20-45 us per step: inductor's C++-wrapper entry turns the symbolic int into a tensor at every call; the
  generated code itself runs as fast). Set False for those few percent when compile time does not matter.
* CUDA default: static, until measured on a GPU (profiles/gpu_check.py: capture seconds, graphs per kind, graph
  pool MiB and ms/token at 1k/8k/32k, static against `symbolic_read_len=True`). Symbolic sizes change what
  inductor generates for the Triton kernels (no size-specialised tiling, index arithmetic on a symbol), which is
  where a decode step's time goes there, so it is not switched on unmeasured.

Always fullgraph=True (a graph break inside a step is a bug, not a fallback) and dynamic=False: nothing but the
read length may become symbolic, not the batch, the chunk or a tensor of a regrown cache (torch's automatic
dynamic shapes would otherwise turn whatever changed between two compiles symbolic, and the Python int read_len
after its second value). On a torch without DynamicInt (< 2.9) a symbolic read length falls back to automatic
dynamic shapes with every tensor the steps take marked static: the first rung compiles static, the second
symbolic, so at most 2 compiles per kind.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config as inductor_config

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")

# Measured on the embedded default model (profiles/compile_cpu.md): the C++ wrapper is the fastest CPU
# setting there. Building its kernels apart from the wrapper (`cpp_wrapper_build_separate`, where this torch has
# it) cuts a cold compile of SmolLM2-135M's greedy decode step (max_len 2048, empty caches, run alone) from 165 to
# 110 s at the same ms/token (40.6 vs 40.4, interleaved): g++ no longer optimises the wrapper of a 30-layer step
# as one huge translation unit with its kernels (profiles/RESULTS.md, "Capture").
# Regional compilation (torch.compiler.nested_compile_region per layer half: 82 s) is not usable with the C++
# wrapper in torch 2.13 (it cannot generate invoke_subgraph) and the Python wrapper decodes 10% slower.
# Override with CompileSettings(...) when your CPU model says otherwise.
CPU_OPTIONS: Mapping[str, Any] = {"cpp_wrapper": True} | (
    {"cpp_wrapper_build_separate": True} if hasattr(inductor_config, "cpp_wrapper_build_separate") else {}
)

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
    dynamic: bool | None = False  # torch.compile's flag: tensor shapes stay static (see the module docstring)
    backend: str = "inductor"  # "eager"/"aot_eager": dynamo only (debugging, fast tests); no mode/options
    symbolic_read_len: bool = False  # one compile per kind for every rung (True) or one per (kind, rung) (False)

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
        if not isinstance(self.symbolic_read_len, bool):
            raise TypeError(f"symbolic_read_len must be a bool, got {self.symbolic_read_len!r}")
        object.__setattr__(self, "options", dict(self.options))

    @classmethod
    def for_device(cls, device: torch.device | str, *, collectives: str | None = None) -> CompileSettings:
        """The measured default: reduce-overhead (CUDA graphs) and a static read length on CUDA; the C++ wrapper
        and a symbolic read length on CPU (the module docstring says why).

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
            return cls(options=CPU_OPTIONS, symbolic_read_len=True)
        return cls()

    def cudagraphs(self, device: torch.device | str) -> bool:
        """Whether steps compiled with these settings on `device` run as CUDA graphs."""
        on_cuda = torch.device(device).type == "cuda" and self.backend == "inductor"
        return on_cuda and (self.mode in CUDAGRAPH_MODES or bool(self.options.get("triton.cudagraphs")))

    def describe(self) -> str:
        read = " + symbolic read_len" if self.symbolic_read_len else ""
        if self.backend != "inductor":
            return f"backend={self.backend}{read}"
        if self.options:
            return "options=" + ",".join(f"{k}={v}" for k, v in sorted(self.options.items())) + read
        return f"mode={self.mode or 'default'}{read}"

    def compile(self, fn: Callable[..., Any], *, graphs: int, symbolic: bool = False) -> Callable[..., Any]:
        """torch.compile `fn`, allowing it `graphs` compiled graphs (its read buckets).

        symbolic: the caller passes the read length as `dc.dynamic_int(n)` (a symbol from the first compile).
        Where this torch lacks DynamicInt, automatic dynamic shapes (dynamic=None) make it symbolic at its second
        value instead; the caller marks every tensor static so that nothing else can turn symbolic.

        Where torch supports it (2.13+), the limit (`graphs` + RECOMPILE_HEADROOM) is set on this compile and
        its graphs are isolated from other compiles of the same function (several Generators in one process do
        not share or exhaust one code cache). Older torch (2.11 on the GPU machines) has only the process-wide
        limits, shared by every compile of a function: the caller (`StepRegistry`) raises those to the graphs
        of every registry so far plus the headroom, never lowering them.
        """
        from capture import _dynamo_counters as dc  # here: `import capture.settings` stays free of torch internals

        dynamic = self.dynamic
        if symbolic and dynamic is False and not dc.has_dynamic_int():
            dynamic = None
        kwargs: dict[str, Any] = {"fullgraph": self.fullgraph, "dynamic": dynamic, "backend": self.backend}
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

    The cost of "all": one compile per kind with a symbolic read length (the CPU default), kinds x buckets with a
    static one (CUDA), tens of seconds each for a large model, and on CUDA one CUDA graph per (kind, bucket); the
    gain: no compile or capture ever lands in the middle of a request. Restrict `kinds` to those you use (e.g.
    the greedy ones) to capture fewer graphs; the others still compile lazily if a request needs them.

    compile_cache: a directory that keeps what a new process needs to skip compiling these steps (inductor's
    caches, and on CUDA torch's cache artifacts), used in preference to the inductor cache the environment names;
    see capture.compile_cache. None: the environment's inductor cache, as torch.compile does by default.
    """

    buckets: Any = None  # BucketLadder, a list of read lengths ending at max_len, or None: the default ladder
    settings: CompileSettings | None = None  # None: CompileSettings.for_device(the model's device)
    warm_up: str = "all"  # "all": every (kind, bucket) when the cache is allocated; "lazy": at first use
    kinds: tuple[str, ...] | None = None  # kinds to warm up (None: all of them)
    progress: bool = True  # a progress bar and the total capture time on stderr during warm-up
    fallback: bool | None = None  # a kind that fails to compile runs eagerly; None: only for a tensor-parallel model
    compile_cache: Path | None = None  # a persistent compile cache directory (str or path accepted)

    def __post_init__(self) -> None:
        if self.compile_cache is not None:
            if not isinstance(self.compile_cache, str | os.PathLike) or not str(self.compile_cache):
                raise TypeError(f"compile_cache must be a directory path, got {self.compile_cache!r}")
            object.__setattr__(self, "compile_cache", Path(self.compile_cache).expanduser())
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
