"""The host side of generation: one cache and one set of step buffers, reused across requests.

Per request the host checks everything first (static_decode.generation.request: a refused request changes nothing),
fills the step buffers, then only launches steps (static_decode.steps.functions) back to back: prefill chunks, the
first token, then one decode step per token. It never reads the device lengths (it keeps an upper bound), and reads
emitted tokens back only every `read_every` steps: the one sync of decode. The runner (`StepRunner`: eager, or
capture's `CompiledRunner`) picks read lengths and step callables; speculation's loop is speculative_loop.
Design notes: docs/internals.md#generator.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from capture.settings import CaptureOptions
from static_decode.base.checks import check_int
from static_decode.core.cache import StaticKVCache
from static_decode.generation import host_loop, scoring, structured
from static_decode.generation.memory import cache_bytes, check_fits, generation_bytes
from static_decode.generation.request import Request, SamplingOptions, SamplingParams, check_request
from static_decode.generation.stats import GenerationStats
from static_decode.kernels import cpu_kernel
from static_decode.model.llama import Llama
from static_decode.steps.functions import (
    PAD,
    STEPS,
    EagerRunner,
    StepBuffers,
    StepFn,
    StepRunner,
    sampling,
)
from static_decode.steps.speculation import DraftModel, PromptLookup, Speculation
from static_decode.steps.verify import speculative_steps

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from capture.report import CaptureRecord, CaptureReport

# Prompt slots per prefill step. Compiled SmolLM2 prefill on the CPU (profiles/RESULTS.md), seconds at 128 / 1,024
# prompt tokens: chunk 64 0.22 / 1.91, 128 0.146 / 1.35, 256 0.28 / 1.32 (a short prompt pays for the padding).
DEFAULT_CHUNK_SIZE = 128
# Prompt slots per *long* prefill step, run uncompiled: once a prompt has this many tokens left, a chunk this long
# is GEMM-bound, so inductor's fusion of the small ops gains little and a compile costs a minute, while one long
# chunk's GEMMs run far faster than four short ones' (oneDNN's bf16 GEMMs most of all). SmolLM2-135M on the CPU,
# 1,024 prompt tokens, s (profiles/RESULTS.md, "Prefill"): float32 compiled 128-chunks 1.23, eager 512-chunks 1.15;
# bfloat16 0.61 -> 0.41. None = this default when it exceeds chunk_size, else off; 0 = off.
DEFAULT_LONG_CHUNK = 512
DEFAULT_READ_EVERY = 16  # decode steps between read-backs of the emitted tokens


class Generator:
    """Greedy or sampled generation over one static cache, reused across requests.

    The cache holds `batch` rows when given (requests with more rows are refused); otherwise it is allocated
    at the first request and reallocated only when a request has more rows than any before it (so it is sized
    for the largest batch seen, and never regrown for a batch it already fits). Smaller requests run on the
    same buffers with the spare rows idle, so the step shapes do not change. Not re-entrant: finish (or close)
    one stream before starting the next request.

    max_logprobs (None: off): the steps also keep every emitted token's logprob and its `max_logprobs` best
    alternatives (a top-k over the vocabulary per step), so requests may ask for `logprobs` / `prompt_logprobs` up
    to it (SamplingParams; the records: static_decode.steps.logprobs).

    grammar_tables ((states, token classes); None: off): the device tables of structured output, so requests may
    set SamplingParams.grammar (structured.DEFAULT_GRAMMAR_TABLES: 1024 x 1024, 4 MiB of int32 next states, plus
    4 B a token and 1 B a token per row). `structured_path` says which path the last request took ("device",
    "host" or None) and `structured_why` why it went to the host.
    """

    def __init__(
        self,
        model: Llama,
        *,
        max_len: int,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        long_chunk: int | None = None,
        compile: bool = False,
        batch: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        read_every: int = DEFAULT_READ_EVERY,
        capture: CaptureOptions | None = None,
        speculate: Speculation | None = None,
        max_logprobs: int | None = None,
        grammar_tables: tuple[int, int] | None = None,
    ) -> None:
        if not isinstance(model, Llama):
            raise TypeError(f"model must be a static_decode.Llama, got {type(model).__name__}")
        model.tp.require_group()  # a tensor-parallel shard needs its process group for every step
        self.model = model
        self.max_len = check_int("max_len", max_len, minimum=2)
        model.check_max_len(self.max_len)  # checked before allocating (a sliding window is a mask: any length)
        self.chunk_size = check_int("chunk_size", chunk_size, minimum=1)
        if long_chunk is None:
            self.long_chunk = DEFAULT_LONG_CHUNK if self.chunk_size < DEFAULT_LONG_CHUNK else 0
        else:
            self.long_chunk = check_int("long_chunk", long_chunk, minimum=0)
            if 0 < self.long_chunk <= self.chunk_size:
                raise ValueError(
                    f"long_chunk={long_chunk} must exceed chunk_size={self.chunk_size} (or be 0: no long chunks)"
                )
        self.read_every = check_int("read_every", read_every, minimum=1)
        self.max_logprobs = None if max_logprobs is None else check_int("max_logprobs", max_logprobs, minimum=0)
        self.prompt_logprobs: list | None = None  # the last request's prompt records (prompt_logprobs set)
        if grammar_tables is not None:
            grammar_tables = (check_int("grammar_tables states", grammar_tables[0], minimum=1),
                              check_int("grammar_tables classes", grammar_tables[1], minimum=1))
        self.grammar_tables = grammar_tables
        self.structured_path: str | None = None
        self.structured_why: str | None = None
        self.compile = bool(compile)
        if self.compile and model.attn_impl == "flex" and model.device.type != "cuda":
            raise ValueError(
                f"attn_impl='flex' compiles only on CUDA (inductor's CPU flex template does not take this mask), the "
                f"model is on {model.device}; use attn_impl='sdpa_folded' there"
            )
        if capture is not None and not isinstance(capture, CaptureOptions):
            raise TypeError(f"capture must be a capture.CaptureOptions, got {type(capture).__name__}")
        self.capture = capture if capture is not None or not self.compile else CaptureOptions()
        self.fixed_batch = None if batch is None else check_int("batch", batch, minimum=1)
        eos = model.config.eos_token_ids if eos_token_ids is None else tuple(eos_token_ids)
        for i in eos:
            check_int("eos token id", i, minimum=0)
            if i >= model.config.vocab_size:
                raise ValueError(f"eos token id {i} is past the vocabulary ({model.config.vocab_size})")
        self.eos_token_ids = tuple(int(i) for i in eos)
        if speculate is not None:
            if not isinstance(speculate, PromptLookup | DraftModel):
                raise TypeError(f"speculate must be a PromptLookup or a DraftModel, got {type(speculate).__name__}")
            if model.tp.enabled:
                raise ValueError("speculate is not supported on a tensor-parallel model")
            if isinstance(speculate, DraftModel):
                speculate.check_target(model)
                speculate.model.check_max_len(self.max_len)
        self.speculate = speculate
        if model.device.type == "cpu":
            # Build (or load) the CPU kernels now: the first step to need them would otherwise pay the one-time
            # build (minutes) inside its own timing (a demo's first decode, a bench's first request).
            cpu_kernel.available()
        if isinstance(speculate, DraftModel):
            self.long_chunk = 0  # a draft model prefills chunk by chunk beside the target (its draft_prefill kind)
        self.draft_cache: StaticKVCache | None = None  # a DraftModel's own cache, allocated with the target's
        self.cache: StaticKVCache | None = None
        self.bufs: StepBuffers | None = None
        self.runner: StepRunner = EagerRunner()  # compile=True: a capture.CompiledRunner once allocated
        self.stats: GenerationStats | None = None
        self._busy = False  # a request is running on the cache (an open stream, say)
        self.epoch = 0  # counts cache resets: a Conversation checks that its history is still what is cached
        if self.fixed_batch is not None:
            self._allocate(self.fixed_batch)

    # ---- the runner: read lengths, step callables, capture --------------------------------------------------
    def read_len(self, longest: int) -> int:
        """The read length of a step whose longest row (after it) holds `longest` tokens."""
        return self.runner.read_len(longest)

    def step_fn(self, kind: str, read_len: int) -> StepFn:
        """The callable `fn(model, cache, bufs, read_len)` that runs step `kind` at `read_len`."""
        return self.runner.step(kind, read_len)

    @property
    def capture_records(self) -> list[CaptureRecord]:
        """What was compiled so far, one record per (kind, read bucket); empty unless compile=True."""
        return list(getattr(self.runner, "records", {}).values())

    def warm_up(
        self, kinds: Iterable[str] | None = None, *, buckets: Iterable[int] | None = None, progress: bool = True
    ) -> CaptureReport:
        """compile=True: compile (and capture) `kinds` (default: all) at `buckets` (read lengths, rounded up to
        their rungs; default: every rung) now rather than at first use. Allocates the cache if needed."""
        if not self.compile:
            raise ValueError("warm_up needs Generator(..., compile=True); eager steps have nothing to capture")
        if self.cache is None:
            self._allocate(1)
        return self.runner.warm_up(kinds, buckets=buckets, progress=progress)

    def _allocate(self, batch: int) -> None:
        m = self.model
        # Refuse a size the device cannot hold before anything is allocated: one ValueError in GiB instead of an
        # allocator traceback (or the OOM killer), and this generator keeps its current cache and buffers.
        spec = self.speculate
        draft = spec.model if isinstance(spec, DraftModel) else None
        K = 0 if spec is None else spec.tokens
        draft_vocab = m.config.vocab_size if draft is not None else 0
        need = generation_bytes(
            m.config, batch, self.max_len, self.chunk_size, len(self.eos_token_ids), m.dtype, kv_heads=m.kv_heads,
            draft_tokens=K, draft_vocab=draft_vocab, long_chunk=self.long_chunk, kv_dtype=m.kv_dtype,
            logprobs=self.max_logprobs, grammar=self.grammar_tables,
        )
        if draft is not None:
            need += cache_bytes(draft.config, batch, self.max_len, draft.kv_dtype, kv_heads=draft.kv_heads)
        check_fits(need, m.device, "the KV cache and step buffers")
        close = getattr(self.runner, "close", None)
        if close is not None:  # compiled steps over the old cache would otherwise keep it alive (CUDA graphs)
            close()
        # the old state goes before the new comes
        self.runner, self.cache, self.bufs, self.draft_cache = EagerRunner(), None, None, None
        self.cache = m.new_cache(batch, self.max_len)
        self.bufs = StepBuffers.allocate(
            batch, self.chunk_size, self.max_len, m.config.hidden_size, len(self.eos_token_ids),
            dtype=m.dtype, device=m.device, draft_tokens=K, draft_vocab=draft_vocab, long_chunk=self.long_chunk,
            vocab=m.config.vocab_size, logprobs=self.max_logprobs, grammar=self.grammar_tables,
        )
        steps = dict(STEPS)
        if spec is not None:
            self.draft_cache = None if draft is None else draft.new_cache(batch, self.max_len)
            steps.update(speculative_steps(spec, self.draft_cache))
        self.runner = EagerRunner(steps)
        if self.compile:  # loaded here: the capture layer pulls in torch._dynamo, which eager use never needs
            from capture.runner import CompiledRunner

            self.runner = CompiledRunner(
                m, self.cache, self.bufs, self.capture, steps=steps, draft_cache=self.draft_cache
            )

    # ---- requests ---------------------------------------------------------------------------------------
    def _check(self, prompt: object, max_new_tokens: int, sampling: SamplingParams) -> Request:
        req = check_request(
            prompt, max_new_tokens, sampling, vocab_size=self.model.config.vocab_size, max_len=self.max_len,
            max_batch=self.fixed_batch, draft_slots=self.draft_slots,
        )
        self.check_penalty(req)
        return req

    def check_penalty(self, req: Request) -> None:
        """The repetition, presence and frequency penalties change the target's distribution token by token, which
        a verify step's drafts were not drawn from, and the verify steps apply neither min_p nor the logit bias:
        each is refused with speculation (naming the first one set). Also refused: logprobs past `max_logprobs`."""
        scoring.check(req, self.max_logprobs)
        if req.grammar is not None and self.speculate is not None:
            raise ValueError("grammar (structured output) is not supported with speculative decoding")
        if req.grammar is not None and self.grammar_tables is None:
            raise ValueError("grammar (structured output) needs Generator(..., grammar_tables=(states, classes))")
        on = req.samplers_on()
        if on and self.speculate is not None:
            raise ValueError(f"{on[0]} is not supported with speculative decoding")

    @property
    def draft_slots(self) -> int:
        """Positions past a row's length that a verify step writes (K with speculation, else 0)."""
        return 0 if self.speculate is None else self.speculate.tokens

    def generate(
        self,
        prompt: Sequence[int] | Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        **options: Unpack[SamplingOptions],
    ) -> list[int] | list[list[int]]:
        """New token ids for a prompt (a list of ids) or for each prompt of a ragged batch (a list of lists).

        How tokens are picked: `sampling` (default greedy) with `options` over it, SamplingParams' fields by name
        (`temperature`, `top_k`, `top_p`, `seed`, `stop_at_eos`, `repeat_penalty`, `min_p`, `presence_penalty`,
        `frequency_penalty`, `logit_bias`, `logprobs`, `prompt_logprobs`); checked before anything runs. With
        `logprobs` set, each new token is a TokenLogprob record instead of an id; with `prompt_logprobs`, the
        prompt's records are `self.prompt_logprobs` afterwards (the first token's logprob None).
        """
        req = self._check(prompt, max_new_tokens, SamplingParams.of(sampling, **options))
        out: list[list[int]] = [[] for _ in req.rows]
        for piece in self._run(req, self.read_every):
            for b, toks in enumerate(piece):
                out[b].extend(toks)
        return out[0] if req.single else out

    def stream(
        self,
        prompt: Sequence[int] | Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        *,
        read_every: int | None = None,
        **options: Unpack[SamplingOptions],
    ) -> Iterator[int] | Iterator[list[list[int]]]:
        """Like `generate`, but yields tokens as they are read back: every `read_every` steps (default: the
        generator's), and the first token as soon as it exists. For a single prompt it yields token ids one by
        one; for a batch, one list of new ids per row at each read. The request is checked before this returns."""
        req = self._check(prompt, max_new_tokens, SamplingParams.of(sampling, **options))
        every = self.read_every if read_every is None else check_int("read_every", read_every, minimum=1)
        pieces = self._run(req, every)
        return pieces if not req.single else (t for piece in pieces for t in piece[0])

    # ---- one request on the device ------------------------------------------------------------------------
    def _prepare(self, req: Request, keep_cache: bool = False, history: Sequence[int] = ()) -> list[int]:
        """Reset the cache (unless a conversation continues on it) and fill the per-request buffers (allocating,
        and capturing, on first need). `history`: what row 0 of a kept cache holds before the request's row, which
        prompt lookup searches as it would the same tokens fed in this request; returns the part of it kept (none
        when the cache was reset)."""
        if self.cache is None or len(req.rows) > self.cache.batch:
            self._allocate(len(req.rows))
            keep_cache = False
        cache, bufs = self.cache, self.bufs
        B = cache.batch
        if not keep_cache:
            cache.reset()
            self.epoch += 1
            bufs.seen.zero_()  # a continued conversation keeps the tokens of its earlier turns marked
        seed = self.model.tp.shared_random_bits(64) if req.seed is None else req.seed  # same on every rank
        R = len(req.rows)
        bufs.done.copy_(torch.from_numpy(np.arange(B) >= R))  # spare rows are done from the start
        bufs.step.zero_()
        bufs.live_steps.zero_()
        bufs.out.fill_(PAD)
        bufs.limit.fill_(req.max_new_tokens)
        history = list(history) if keep_cache else []
        searched = [history + req.rows[0], *req.rows[1:]]  # row 0 continues its cached sequence
        plen = np.array([len(r) for r in searched] + [0] * (B - R), dtype=np.int64)
        bufs.plen.copy_(torch.from_numpy(plen))
        if self.speculate is not None:  # prompt lookup searches the prompt; a draft model reads nothing there
            hist = np.zeros((B, int(plen.max())), dtype=np.int64)
            for b, row in enumerate(searched):
                hist[b, : len(row)] = row
            bufs.hist[:, : hist.shape[1]].copy_(torch.from_numpy(hist))
        bufs.next.zero_()
        bufs.temperature.fill_(req.temperature)
        bufs.top_k.fill_(req.top_k or 0)
        bufs.top_p.fill_(1.0 if req.top_p is None else req.top_p)
        bufs.seed.copy_(torch.tensor([sampling.row_seed(seed, b) for b in range(B)], dtype=torch.int64))
        bufs.repeat_penalty.fill_(req.repeat_penalty)
        bufs.counts.zero_()  # presence / frequency count this request's own output (a conversation turn's too)
        bufs.presence_penalty.fill_(req.presence_penalty)
        bufs.frequency_penalty.fill_(req.frequency_penalty)
        bufs.min_p.fill_(req.min_p)
        M = bufs.bias_ids.shape[1]
        bias_ids, bias_values = np.zeros((B, M), dtype=np.int64), np.zeros((B, M), dtype=np.float32)
        bias_ids[:R, : len(req.logit_bias)] = [t for t, _ in req.logit_bias]  # every row of the request, alike
        bias_values[:R, : len(req.logit_bias)] = [v for _, v in req.logit_bias]
        bufs.bias_ids.copy_(torch.from_numpy(bias_ids))
        bufs.bias_values.copy_(torch.from_numpy(bias_values))
        width = max(len(r) for r in req.rows)
        marks = np.full((B, width), bufs.seen.shape[1] - 1, dtype=np.int64)  # the trash column past the vocabulary
        for b, row in enumerate(req.rows):
            marks[b, : len(row)] = row
        bufs.seen.scatter_(1, torch.from_numpy(marks).to(bufs.seen.device), True)  # the prompt counts as seen
        eos = list(self.eos_token_ids) if req.stop_at_eos else []
        bufs.eos.copy_(torch.tensor(eos + [-1] * (bufs.eos.shape[0] - len(eos)), dtype=torch.int64))
        self._constraint = structured.start(req.grammar, bufs, R, eos)
        self.structured_path = None if self._constraint is None else self._constraint.path
        self.structured_why = None if req.grammar is None else structured.why_host(req.grammar, bufs, eos)
        return history

    def _run(
        self, req: Request, every: int, keep_cache: bool = False, history: Sequence[int] = ()
    ) -> Iterator[list[list[int]]]:
        """Run one checked request, yielding each read-back as a list of new tokens per row. keep_cache: append
        to the rows already cached (a conversation's next turn) instead of starting from an empty cache;
        `history`: the tokens row 0 then holds (prompt lookup searches them with the new ones)."""
        if self._busy:  # checked before anything changes: the open request keeps its cache and buffers
            raise RuntimeError(
                "this Generator is still running a stream: finish it (or call its .close()) before the next "
                "request, which would otherwise reset the cache under it"
            )
        self._busy = True
        try:
            yield from host_loop.run(self, req, every, keep_cache, history)
        finally:
            self._busy = False
