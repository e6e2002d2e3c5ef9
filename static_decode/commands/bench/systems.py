"""The decode systems `static-decode bench` times side by side on the same weights, greedy unless a request form
(bench.requests) says otherwise.

A system runs one request in two calls, so the harness can time prefill and decode apart with the same wall
clock for every system:

    system.start(prompt, new_tokens)   # reset, prefill the prompt, emit the first token (it is on the host)
    tokens = system.finish()           # the other new_tokens - 1 decode steps; all new tokens on the host

EOS never stops a request (every system emits exactly new_tokens), so every request does the same work. The
systems: static-decode (compiled), static-decode-lookup, static-decode-eager, full-read, concat, transformers
(its StaticCache loop, decode compiled) and llama.cpp (one worker process per GGUF, greedy by argmax of the
logits). What each is: docs/internals.md#bench-systems.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch

from capture.buckets import BucketLadder
from capture.settings import CaptureOptions
from static_decode.checkpoints.gguf import is_gguf
from static_decode.checkpoints.quant_io import stored_quantization
from static_decode.commands.bench import baselines
from static_decode.commands.bench.peer import PeerFailed, PeerProcess, has_amx
from static_decode.commands.bench.requests import FORMS, RequestForm, describe, generator_options, sampling
from static_decode.generation.generator import Generator
from static_decode.generation.request import SamplingParams
from static_decode.model.llama import Llama
from static_decode.steps.functions import GREEDY_KINDS, SAMPLED_KINDS
from static_decode.steps.speculation import PromptLookup
from static_decode.steps.verify import speculative_kinds

SYSTEMS = ("static-decode", "static-decode-lookup", "static-decode-eager", "full-read", "concat", "transformers",
           "llama.cpp")
TP_SYSTEMS = ("static-decode", "static-decode-eager", "full-read")  # the ones that run a tensor-parallel shard
PROFILES = Path(__file__).resolve().parents[3] / "profiles"  # only in a source checkout


class System(Protocol):
    name: str
    mode: str  # how it runs, for the output ("compiled (options=cpp_wrapper=True), ladder 256..2048")

    def start(self, prompt: list[int], new_tokens: int) -> None: ...

    def finish(self) -> list[int]: ...


def load_profiles_module(name: str) -> ModuleType | None:
    """profiles/<name>.py loaded by file path (a source checkout), or None when it is not there."""
    file = PROFILES / f"{name}.py"
    if not file.is_file():
        return None
    spec = importlib.util.spec_from_file_location(f"static_decode_profiles_{name}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class GeneratorSystem:
    """static-decode, static-decode-eager and full-read: one Generator, reused across requests."""

    def __init__(
        self, name: str, model: Llama, max_len: int, settings: Any = None, request: RequestForm | None = None,
        path: Path | None = None,
    ) -> None:
        self.name = name
        request = request or FORMS["greedy"]
        self.sampling = SamplingParams(stop_at_eos=False)
        if name == "static-decode-eager":
            self.gen = Generator(model, max_len=max_len, batch=1)
            self.mode = "eager, reads the live length"
            return
        spec = PromptLookup() if name == "static-decode-lookup" else None
        kinds = SAMPLED_KINDS if request.sampled else GREEDY_KINDS
        if spec is not None:
            kinds = (*kinds, *speculative_kinds(spec, greedy=True))
            max_len += spec.tokens  # the last verify step writes its drafts past the longest request
        ladder = BucketLadder.of([max_len], max_len) if name == "full-read" else None  # None: the runner's default
        opts = CaptureOptions(buckets=ladder, settings=settings, kinds=kinds, progress=False)
        if request.name != "greedy":
            self.sampling = sampling(request, path, model.config.vocab_size)
        self.gen = Generator(model, max_len=max_len, batch=1, compile=True, capture=opts, speculate=spec,
                             **generator_options(request))
        rungs = ",".join(map(str, self.gen.runner.ladder.lengths))
        self.mode = f"compiled ({self.gen.runner.settings.describe()}), reads rungs [{rungs}]"
        if spec is not None:
            self.mode += f", prompt lookup ({spec.tokens} drafts, {spec.ngram}-gram, adaptive)"
        if request.name != "greedy":
            self.mode += f", requests {request.name} ({describe(request)})"
        self._stream = None

    def start(self, prompt: list[int], new_tokens: int) -> None:
        self._stream = self.gen.stream(prompt, new_tokens, self.sampling)
        self._first = next(self._stream)  # returns once token 0 is back on the host

    def finish(self) -> list[int]:
        # a logprobs request yields TokenLogprob records; the bench compares token ids
        return [getattr(t, "token", t) for t in (self._first, *self._stream)]

    def read_len(self, length: int) -> int:
        """The read length of a step whose longest row holds `length` tokens."""
        return self.gen.read_len(length)


class _LoopSystem:
    """A host loop of greedy steps: tokens stay on the device, one read-back at the end (like the Generator's
    read_every, with one read per request)."""

    def _prefill(self, ids: torch.Tensor) -> torch.Tensor: ...  # [1, L] -> next token [1, 1]

    def _decode(self, token: torch.Tensor) -> torch.Tensor: ...  # [1, 1] -> next token [1, 1]

    def start(self, prompt: list[int], new_tokens: int) -> None:
        self._left = new_tokens - 1
        with torch.no_grad():
            self._token = self._prefill(torch.tensor([prompt], dtype=torch.int64, device=self.device))
        self._first = int(self._token)  # token 0 on the host, as the Generator reads it

    def finish(self) -> list[int]:
        out = torch.empty((1, self._left), dtype=torch.int64, device=self.device)  # [1, N-1]
        token = self._token
        with torch.no_grad():
            for i in range(self._left):
                token = self._decode(token)
                out[:, i : i + 1].copy_(token)  # kept: a CUDA-graph output is overwritten by the next replay
        return [self._first, *out[0].tolist()]  # the one read-back of the decode loop


class ConcatSystem(_LoopSystem):
    """bench/baselines.py's ConcatDecoder (naive: torch.cat cache, repeated KV heads), eager."""

    def __init__(self, baselines: ModuleType, model: Llama) -> None:
        self.name = baselines.NAME
        self.decoder = baselines.ConcatDecoder(model)
        self.device = model.device
        self.mode = "eager baseline: cache grown by torch.cat every step, KV heads repeated (bench/baselines.py)"

    def _prefill(self, ids: torch.Tensor) -> torch.Tensor:
        self.decoder.reset()
        return self.decoder.step(ids)[:, -1].argmax(-1, keepdim=True)

    def _decode(self, token: torch.Tensor) -> torch.Tensor:
        return self.decoder.step(token)[:, -1].argmax(-1, keepdim=True)


def _hf_decode_one(
    model: Any, token: torch.Tensor, cache_position: torch.Tensor, cache: Any, cache_kw: str
) -> torch.Tensor:
    """One greedy decode step of a transformers causal LM over its StaticCache (the docs' decode_one_tokens).

    cache_kw: the forward's cache argument, `past_key_values` (4.x) or `cache` (5.x renames it); cache_position
    is what 4.x positions and writes by (5.x takes the positions from the cache and ignores it)."""
    logits = model(token, cache_position=cache_position, **{cache_kw: cache}, return_dict=False, use_cache=True)[0]
    return logits[:, -1].argmax(-1, keepdim=True)  # [1, 1] from logits [1, 1, V]


class TransformersSystem(_LoopSystem):
    """transformers' model of the checkpoint + StaticCache(max_cache_len=max_len), the docs' custom decode loop."""

    name = "transformers"

    def __init__(
        self, path: Path, dtype: torch.dtype, device: torch.device, max_len: int, compile: bool,
        backend: str = "inductor",  # tests: "eager" (dynamo's fullgraph trace, no inductor)
    ) -> None:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        self.cache = transformers.StaticCache(config=self.model.config, max_cache_len=max_len)
        self.device = device
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._step = _hf_decode_one
        attn = self.model.config._attn_implementation
        self.mode = f"eager ({attn} attention; reads all max_len={max_len} cache slots)"
        if compile:
            try:
                mode = {"mode": "reduce-overhead"} if backend == "inductor" else {}
                self._step = torch.compile(_hf_decode_one, backend=backend, fullgraph=True, **mode)
                t0 = time.perf_counter()
                self.start([1, 2, 3], 3)  # compile now, not in a timed request
                self.finish()
                how = "mode='reduce-overhead'" if backend == "inductor" else f"backend={backend!r}"
                self.mode = (
                    f"decode step torch.compile({how}, fullgraph=True) as its docs show "
                    f"({'CUDA graphs' if device.type == 'cuda' else 'no CUDA graphs on CPU: inductor default'}; "
                    f"compiled in {time.perf_counter() - t0:.0f} s), prefill eager; {attn} attention; "
                    f"reads all max_len={max_len} cache slots"
                )
            except Exception as e:  # noqa: BLE001 - any compile failure means: measure it eager, and say so
                self._step = _hf_decode_one
                self.mode += f" (torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:120]})"

    def _prefill(self, ids: torch.Tensor) -> torch.Tensor:
        self.cache.reset()
        L = ids.shape[1]
        self._pos = torch.tensor([L], device=self.device)
        logits = self.model(
            ids, cache_position=torch.arange(L, device=self.device), **{self._cache_kw: self.cache},
            return_dict=False, use_cache=True, logits_to_keep=1,
        )[0]  # [1, 1, V]
        return logits[:, -1].argmax(-1, keepdim=True)

    def _decode(self, token: torch.Tensor) -> torch.Tensor:
        # clone: under CUDA graphs the previous output is overwritten by the next replay (the docs do the same)
        out = self._step(self.model, token.clone(), self._pos, self.cache, self._cache_kw)
        self._pos += 1
        return out


class LlamaCppSystem:
    """llama.cpp through llama-cpp-python on a GGUF, greedy: argmax of the logits of the last evaluated token,
    in a worker process of its own (static_decode.commands.bench.llama_cpp_worker): a crash or a hang of the peer
    raises PeerFailed, which the bench reports as this system's row.

    `Llama.eval` runs llama_decode and keeps no logits when logits_all=False (its sampler reads them from the
    context), so the row is read from the context itself with llama_get_logits_ith(ctx, -1). That leaves out
    llama.cpp's sampler chain (penalties, top-k, temperature): the token is decided by the logits alone, as in
    every other system, and ties go to the lowest id as with torch.argmax. start and finish are one round trip
    each over the pipe (tens of microseconds; finish's is shared by all its decode steps)."""

    name = "llama.cpp"
    WORKER = "static_decode.commands.bench.llama_cpp_worker"

    def __init__(self, gguf: Path, max_len: int, threads: int, timeout_s: float = 600.0) -> None:
        root = str(Path(__file__).resolve().parents[3])  # the worker imports this package, installed or not
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
        self.peer = PeerProcess(self.WORKER, timeout_s, env=env)
        self.system_info = ""  # llama.cpp's system line: whether its build uses AMX
        try:
            info = self.peer.call({"op": "info"})
            self.system_info = info["system_info"]
            # n_ctx = max_len: the same capacity as the other systems' caches
            facts = self.peer.call({"op": "load", "gguf": str(gguf), "n_ctx": max_len, "threads": threads})
        except PeerFailed as e:
            raise PeerFailed(f"{e.what} loading {gguf.name}", e.detail, self.system_info) from None
        self.mode = (
            f"llama-cpp-python {info['version']}, CPU, {threads} threads, n_ctx {facts['n_ctx']}, n_batch "
            f"{facts['n_batch']}; {gguf.name} (general.file_type {facts['file_type']}; its own dtype, whatever "
            f"--dtype says); greedy by argmax of the last logits row; in a worker process"
            f"{' (its build uses AMX)' if has_amx(self.system_info) else ''}"
        )

    def start(self, prompt: list[int], new_tokens: int) -> None:
        self._first = self.peer.call({"op": "start", "prompt": list(prompt), "new_tokens": new_tokens})["first"]

    def finish(self) -> list[int]:
        return self.peer.call({"op": "finish"})["tokens"]

    def close(self) -> None:
        self.peer.close()


def build(
    name: str, model: Llama, *, path: Path, max_len: int, settings: Any = None, transformers_compile: bool = True,
    gguf: Path | None = None, threads: int = 1, peer_timeout: float = 600.0, request: RequestForm | None = None,
) -> tuple[System | None, str]:
    """The system called `name`, or (None, why it is skipped). `gguf`, `threads` and `peer_timeout` (its worker's
    bounded wait per call): the llama.cpp system's; its PeerFailed goes up to the bench. `request`: the request
    form a static-decode system times (default greedy)."""
    if name in ("static-decode", "static-decode-lookup", "static-decode-eager", "full-read"):
        return GeneratorSystem(name, model, max_len, settings, request, path), ""
    if name == "concat":
        return ConcatSystem(baselines, model), ""
    if name == "transformers":
        if importlib.util.find_spec("transformers") is None:
            return None, "skipped: transformers is not installed (pip install 'static-decode[bench]')"
        if is_gguf(path):
            return None, f"skipped: {path} is a GGUF file; transformers reads a save_pretrained directory"
        if (path / "config.json").is_file() and stored_quantization(path) is not None:
            return None, f"skipped: {path} is a quantized checkpoint; transformers reads float weights"
        return TransformersSystem(path, model.dtype, model.device, max_len, transformers_compile), ""
    if name == "llama.cpp":
        if importlib.util.find_spec("llama_cpp") is None:
            return None, "skipped: llama-cpp-python is not installed (pip install 'static-decode[llamacpp]')"
        if gguf is None:
            return None, ("skipped: no --gguf PATH (a GGUF of the same weights; profiles/smollm2.py --gguf f32 "
                          "writes one with llama.cpp's convert_hf_to_gguf.py)")
        return LlamaCppSystem(gguf, max_len, threads, peer_timeout), ""
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
