"""The host side of generation: one cache and one set of step buffers, reused across requests.

Per request the host validates everything first (a refused request changes nothing), fills the step
buffers, then only launches steps (`static_decode.steps`) back to back: prefill chunks, the first token, then
one decode step per token. It never reads the device lengths; it knows them for prefill (it chose n_new) and
keeps an upper bound during decode (each step adds at most one token per row), from which `_read_len` picks
the read length. Emitted tokens are read back from `bufs.out` in batches (every `read_every` steps and at the
end): that is the only sync during decode, and it is also where the host notices that every row finished.

Two single points the capture layer hooks into: `_read_len(longest)` (the read length of a step, rounded up
to a captured bucket under compile=True) and `_step(kind, read_len)` (the callable to launch: the eager
function from `steps.STEPS` when compile=False, the registry's compiled step otherwise; see capture/).

A tensor-parallel model (`model.tp`, static_decode.parallel) needs nothing else here: every rank runs this same
host loop over its own shard and cache; the step's all-reduces make the logits, hence the tokens, the same on
every rank, so every rank takes the same decisions (EOS, read-backs, read lengths) and the collectives stay in
step. Compiled steps of such a model fall back to eager per kind if they cannot compile (capture.StepRegistry).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from static_decode import ranges, sampling
from static_decode.cache import StaticKVCache
from static_decode.model import Llama
from static_decode.steps import PAD, STEPS, StepBuffers, StepFn

if TYPE_CHECKING:  # capture pulls in torch._dynamo (seconds of import): loaded only when compiling
    from capture import CaptureOptions, StepRegistry

DEFAULT_CHUNK_SIZE = 64  # prompt slots per prefill step
DEFAULT_READ_EVERY = 16  # decode steps between read-backs of the emitted tokens


@dataclass
class GenerationStats:
    """Timings of the last request (host wall clock; each ends at a read-back, so device work is included)."""

    prompt_tokens: int  # real prompt tokens over all rows
    new_tokens: int  # emitted tokens over all rows (EOS included)
    prefill_s: float  # from the request's start to the first token back on the host
    decode_s: float  # from then to the last token back on the host
    decode_steps: int  # decode steps launched (each emits one token per live row)

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.decode_s / self.decode_steps if self.decode_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total > 0 else 0.0

    def summary(self) -> str:
        return (
            f"prefill {1e3 * self.prefill_s:.1f} ms ({self.prompt_tokens} tokens), "
            f"{self.ms_per_step:.2f} ms per decoded token ({self.decode_steps} steps), "
            f"{self.tokens_per_s:.1f} tokens/s ({self.new_tokens} new tokens)"
        )


def _int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class Generator:
    """Greedy or sampled generation over one static cache, reused across requests.

    The cache holds `batch` rows when given (requests with more rows are refused); otherwise it is allocated
    at the first request and reallocated only when a request has more rows than any before it (so it is sized
    for the largest batch seen, and never regrown for a batch it already fits). Smaller requests run on the
    same buffers with the spare rows idle, so the step shapes do not change. Not re-entrant: finish (or close)
    one stream before starting the next request.
    """

    def __init__(
        self,
        model: Llama,
        *,
        max_len: int,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        compile: bool = False,
        batch: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        read_every: int = DEFAULT_READ_EVERY,
        capture: CaptureOptions | None = None,
    ) -> None:
        if not isinstance(model, Llama):
            raise TypeError(f"model must be a static_decode.Llama, got {type(model).__name__}")
        model.tp.require_group()  # a tensor-parallel shard needs its process group for every step
        self.model = model
        self.max_len = _int("max_len", max_len, 2)
        self.chunk_size = _int("chunk_size", chunk_size, 1)
        self.read_every = _int("read_every", read_every, 1)
        self.compile = bool(compile)
        self.capture: CaptureOptions | None = None  # compile=True: buckets, warm-up
        if self.compile or capture is not None:
            from capture import CaptureOptions

            self.capture = CaptureOptions() if capture is None else capture
            if not isinstance(self.capture, CaptureOptions):
                raise TypeError(f"capture must be a capture.CaptureOptions, got {type(capture).__name__}")
        self._registry: StepRegistry | None = None
        self.fixed_batch = None if batch is None else _int("batch", batch, 1)
        eos = model.config.eos_token_ids if eos_token_ids is None else tuple(eos_token_ids)
        for i in eos:
            _int("eos token id", i, 0)
            if i >= model.config.vocab_size:
                raise ValueError(f"eos token id {i} is past the vocabulary ({model.config.vocab_size})")
        self.eos_token_ids = tuple(int(i) for i in eos)
        self.cache: StaticKVCache | None = None
        self.bufs: StepBuffers | None = None
        self.stats: GenerationStats | None = None
        if self.fixed_batch is not None:
            self._allocate(self.fixed_batch)

    # ---- the two hooks the capture layer replaces ------------------------------------------------------
    def _read_len(self, longest: int) -> int:
        """The read length of a step whose longest row (after it) holds `longest` tokens."""
        if self._registry is None:
            return longest
        return self._registry.ladder.bucket_for(longest)

    def _step(self, kind: str, read_len: int) -> StepFn:
        """The callable that runs step `kind` at `read_len`."""
        if self._registry is None:
            return STEPS[kind]
        return self._registry.step(kind, read_len)

    def _capture_steps(self) -> None:
        """compile=True: compile the steps over this cache and these buffers, one graph per (kind, bucket)."""
        from capture import BucketLadder, CompileSettings, StepRegistry, preserving

        cache, bufs, opts, tp = self.cache, self.bufs, self.capture, self.model.tp
        live = [cache.lens, *bufs.tensors().values()]

        def idle() -> contextlib.AbstractContextManager[None]:
            # Warm-up runs with every row done and n_new = 0 (nothing appended: padded K/V goes to the spare
            # row), then every buffer and the lengths are restored.
            return preserving(live, prepare=lambda: (bufs.done.fill_(True), bufs.n_new.zero_()))

        settings = opts.settings or CompileSettings.for_device(cache.device, collectives=tp.backend())
        self._registry = StepRegistry(
            STEPS, BucketLadder.of(opts.buckets, self.max_len), args=(self.model, cache, bufs),
            device=cache.device, settings=settings, unbucketed=("first", "first_greedy"),
            static_tensors=[cache.k, cache.v, *live], scratch=idle,
            fallback=tp.enabled if opts.fallback is None else opts.fallback,
        )
        if opts.warm_up == "all":
            self._registry.warm_up(self._registry.pairs(opts.kinds), progress=opts.progress)

    # ---- allocation ------------------------------------------------------------------------------------
    def _allocate(self, batch: int) -> None:
        m = self.model
        self.cache = m.new_cache(batch, self.max_len)
        self.bufs = StepBuffers.allocate(
            batch,
            self.chunk_size,
            self.max_len,
            m.config.hidden_size,
            len(self.eos_token_ids),
            dtype=m.dtype,
            device=m.device,
        )
        self._registry = None
        if self.compile:
            self._capture_steps()

    # ---- request checks (before anything changes) ------------------------------------------------------
    def _check_request(
        self,
        prompt: object,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        seed: int | None,
    ) -> tuple[list[list[int]], bool]:
        if (
            not isinstance(prompt, Sequence | np.ndarray)
            or isinstance(prompt, str | bytes)
            or len(prompt) == 0
        ):
            raise ValueError(f"prompt must be a non-empty list of token ids or of such lists, got {prompt!r}")
        single = all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in prompt)
        rows = (
            [list(prompt)]
            if single
            else [list(p) if isinstance(p, Sequence | np.ndarray) else p for p in prompt]
        )
        vocab = self.model.config.vocab_size
        max_new = _int("max_new_tokens", max_new_tokens, 1)
        for b, row in enumerate(rows):
            if not isinstance(row, list) or not row:
                raise ValueError(f"prompt row {b} must be a non-empty list of token ids, got {row!r}")
            for t in row:
                if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= t < vocab:
                    raise ValueError(f"prompt row {b} holds {t!r}; token ids must be ints in 0..{vocab - 1}")
            if len(row) + max_new > self.max_len:
                raise ValueError(
                    f"prompt row {b} has {len(row)} tokens; with max_new_tokens={max_new} that needs "
                    f"{len(row) + max_new} > max_len={self.max_len} positions"
                )
        if self.fixed_batch is not None and len(rows) > self.fixed_batch:
            raise ValueError(
                f"the request has {len(rows)} rows, this generator was built for batch={self.fixed_batch}"
            )
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, int | float)
            or not 0 <= temperature < 1e30
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if top_k is not None:
            _int("top_k", top_k, 1)
        if top_p is not None and (
            isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1
        ):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if seed is not None:
            _int("seed", seed, 0)
        return rows, single

    # ---- the request -----------------------------------------------------------------------------------
    def generate(
        self,
        prompt: Sequence[int] | Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_at_eos: bool = True,
    ) -> list[int] | list[list[int]]:
        """New token ids for a prompt (a list of ids) or for each prompt of a ragged batch (a list of lists).

        Greedy when temperature is 0; otherwise sampled on the device (top_k / top_p optional), reproducibly
        when `seed` is given. A row stops after it emits an EOS id (included) when stop_at_eos.
        """
        rows, single = self._check_request(prompt, max_new_tokens, temperature, top_k, top_p, seed)
        out: list[list[int]] = [[] for _ in rows]
        for piece in self._run(
            rows, max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos, self.read_every
        ):
            for b, toks in enumerate(piece):
                out[b].extend(toks)
        return out[0] if single else out

    def stream(
        self,
        prompt: Sequence[int] | Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_at_eos: bool = True,
        read_every: int | None = None,
    ) -> Iterator[int] | Iterator[list[list[int]]]:
        """Like `generate`, but yields tokens as they are read back: every `read_every` steps (default: the
        generator's), and the first token as soon as it exists. For a single prompt it yields token ids one by
        one; for a batch, one list of new ids per row at each read. The request is validated before the first
        `next()` returns (this function checks it eagerly)."""
        rows, single = self._check_request(prompt, max_new_tokens, temperature, top_k, top_p, seed)
        every = self.read_every if read_every is None else _int("read_every", read_every, 1)
        pieces = self._run(rows, max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos, every)
        if not single:
            return pieces
        return (t for piece in pieces for t in piece[0])

    def _prepare(
        self,
        rows: list[list[int]],
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        seed: int | None,
        stop_at_eos: bool,
    ) -> None:
        """Reset the cache and fill the per-request buffers."""
        if self.cache is None or len(rows) > self.cache.batch:
            self._allocate(len(rows))
        cache, bufs = self.cache, self.bufs
        B, dev = cache.batch, cache.device
        cache.reset()
        if seed is None:
            seed = random.getrandbits(64)
        live = np.arange(B) < len(rows)
        bufs.done.copy_(torch.from_numpy(~live))  # spare rows are done from the start
        bufs.step.zero_()
        bufs.next.zero_()
        bufs.temperature.fill_(float(temperature))
        bufs.top_k.fill_(0 if top_k is None else top_k)
        bufs.top_p.fill_(1.0 if top_p is None else float(top_p))
        bufs.seed.copy_(torch.tensor([sampling.row_seed(seed, b) for b in range(B)], dtype=torch.int64))
        eos = list(self.eos_token_ids) if stop_at_eos else []
        bufs.eos.copy_(
            torch.tensor(eos + [-1] * (bufs.eos.shape[0] - len(eos)), dtype=torch.int64, device=dev)
        )

    def _prefill(self, rows: list[list[int]]) -> None:
        """Feed the prompts in chunks of chunk_size slots (the last padded); rows run out at their length."""
        cache, bufs, C = self.cache, self.bufs, self.chunk_size
        lens = np.array([len(r) for r in rows] + [0] * (cache.batch - len(rows)), dtype=np.int64)
        chunk = np.zeros((cache.batch, C), dtype=np.int64)
        for start in range(0, int(lens.max()), C):
            n = np.clip(lens - start, 0, C)
            chunk[:] = 0
            for b, row in enumerate(rows):
                chunk[b, : n[b]] = row[start : start + n[b]]
            n = cache.validate(n, C)
            bufs.chunk.copy_(torch.from_numpy(chunk))
            bufs.n_new.copy_(torch.from_numpy(n))
            read_len = self._read_len(int((cache.host_lens + n).max()))
            with ranges.range(ranges.PREFILL_CHUNK, ranges.COLORS["prefill"]):
                self._step("prefill", read_len)(self.model, cache, bufs, read_len)
            cache.commit(n)

    def _run(
        self,
        rows: list[list[int]],
        max_new: int,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        seed: int | None,
        stop_at_eos: bool,
        every: int,
    ) -> Iterator[list[list[int]]]:
        """Run one checked request, yielding each read-back as a list of new tokens per row."""
        self._prepare(rows, temperature, top_k, top_p, seed, stop_at_eos)  # may allocate and capture: untimed
        t0 = time.perf_counter()
        greedy = temperature == 0
        cache, bufs, model, R = self.cache, self.bufs, self.model, len(rows)
        eos = set(self.eos_token_ids) if stop_at_eos else set()
        emitted = np.zeros(R, dtype=np.int64)
        finished = np.zeros(R, dtype=bool)
        complete = False
        # NVTX ranges wrap each launch on the host (never inside a compiled step). Decode samples inside its step,
        # so "sample" marks only the separate first-token launch.
        sample_range = ranges.range(ranges.SAMPLE, ranges.COLORS["sample"])
        decode_range = ranges.range(ranges.DECODE_STEP, ranges.COLORS["decode"])
        try:
            # Grad mode is set per launch, never held across a yield (it is thread-global state of the caller).
            with torch.no_grad():
                self._prefill(rows)
                with sample_range:
                    self._step("first_greedy" if greedy else "first", 0)(model, cache, bufs, 0)
            longest = int(cache.host_lens.max())  # exact now; an upper bound from here on
            read_from, steps = 0, 0
            kind = "decode_greedy" if greedy else "decode"
            while True:
                if steps + 1 == max_new or steps % every == 0:
                    piece = self._read_back(read_from, steps + 1, finished, emitted, eos)
                    read_from = steps + 1
                    if steps == 0:
                        t1 = time.perf_counter()
                    yield piece
                    if steps + 1 == max_new or finished.all():
                        break
                steps += 1
                read_len = self._read_len(longest + steps)
                with torch.no_grad(), decode_range:
                    self._step(kind, read_len)(model, cache, bufs, read_len)
            t2 = time.perf_counter()
            # Each emitted token except a row's last was fed back: that is how far the device lengths moved.
            cache.commit(np.concatenate([emitted - 1, np.zeros(cache.batch - R, dtype=np.int64)]))
            complete = True
            self.stats = GenerationStats(
                prompt_tokens=sum(len(r) for r in rows),
                new_tokens=int(emitted.sum()),
                prefill_s=t1 - t0,
                decode_s=t2 - t1,
                decode_steps=steps,
            )
        finally:
            if not complete:  # abandoned or failed: leave a consistent, empty cache
                cache.reset()

    def _read_back(
        self, start: int, stop: int, finished: np.ndarray, emitted: np.ndarray, eos: set[int]
    ) -> list[list[int]]:
        """Tokens out[:, start:stop] of the request's rows, PAD stripped; updates `finished` and `emitted`."""
        block = self.bufs.out[: len(finished), start:stop].cpu().numpy()  # the one sync per read
        piece = []
        for b, row in enumerate(block):
            toks = [int(t) for t in row if t != PAD]
            if toks and toks[-1] in eos:
                finished[b] = True
            emitted[b] += len(toks)
            piece.append(toks)
        return piece
