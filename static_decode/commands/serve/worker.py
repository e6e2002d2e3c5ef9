"""The decode worker of `static-decode serve`: one thread owns the generator and runs requests in arrival order.

The generator is not thread-safe, so every request runs on this thread; the HTTP side checks, queues and reads
events, one per read-back. The queue is bounded (one more is HTTP 429), and a request whose client left is
cancelled at its turn or its next read-back. Details: docs/internals.md#serve-worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from static_decode.commands.serve.api import APIError, Completion
from static_decode.commands.serve.logprobs import TokenScore
from static_decode.generation.prefix_cache import PrefixCache
from static_decode.text.stop_strings import StopStrings


@dataclass
class Usage:
    """What the response reports besides the text."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefill_ms: float
    ms_per_token: float

    @staticmethod
    def total(parts: list[Usage]) -> Usage:
        """The usage of several prompts answered in one response: counts and prefill times summed, the time per
        token averaged over the decoded tokens."""
        decoded = sum(u.completion_tokens for u in parts)
        per_token = sum(u.ms_per_token * u.completion_tokens for u in parts) / decoded if decoded else 0.0
        return Usage(sum(u.prompt_tokens for u in parts), decoded, sum(u.cached_tokens for u in parts),
                     sum(u.prefill_ms for u in parts), per_token)

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            # extensions: the prefill (to the first token on the host) and the decode time per token
            "prefill_ms": round(self.prefill_ms, 3), "ms_per_token": round(self.ms_per_token, 3),
        }


@dataclass
class Job:
    """One queued request and the channel back to its HTTP handler. `requests`: its prompts' checked requests, run
    one after another on the decode thread (a prompt list; usually one). Events, for each in turn: ("text", str,
    [TokenScore]: the logprob records of the tokens that text completes, when asked for), then ("done",
    finish_reason, Usage); or ("error", APIError), which ends the job."""

    requests: list[Completion]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def post(self, *event: Any) -> None:
        with contextlib.suppress(RuntimeError):  # RuntimeError: the loop is closed, nobody listens any more
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Worker:
    """The thread that runs every request on `prefix.gen`; see the module docstring."""

    def __init__(self, prefix: PrefixCache, tokenizer: Any, queue_size: int) -> None:
        self.prefix, self.tokenizer = prefix, tokenizer
        self.queue_size = queue_size
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0  # queued, not started
        self._current: Job | None = None
        self._closing = False
        self._seconds = 1.0  # a running mean of the time per request, for Retry-After
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "decoded_tokens": 0}  # for /health
        self._thread = threading.Thread(target=self._loop, name="static-decode-decode", daemon=True)
        self._thread.start()

    # ---- the HTTP side (the event loop's thread) -------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue `job`, or raise APIError 429 (the queue is full) / 503 (shutting down)."""
        with self._lock:
            if self._closing:
                raise _shutting_down()
            if self._waiting >= self.queue_size:
                wait = max(1, math.ceil(self._seconds * (self._waiting + 1)))
                raise APIError(429, f"the server is busy: {self._waiting} requests are waiting (--queue "
                               f"{self.queue_size}); retry after {wait} s", type="rate_limit_error",
                               code="queue_full", headers={"Retry-After": str(wait)})
            self._waiting += 1
        self._jobs.put(job)

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def alive(self) -> bool:
        """Whether the decode thread is still running (a step it cannot leave before it ends)."""
        return self._thread.is_alive()

    def close(self, timeout: float = 0.5) -> None:
        """Refuse new requests, cancel the waiting and the running one (it stops at its next read-back), and
        end the thread."""
        with self._lock:
            self._closing = True
            current = self._current
        if current is not None:
            current.cancelled.set()
        self._jobs.put(None)
        self._thread.join(timeout)

    # ---- the decode thread --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                break
            with self._lock:
                self._waiting -= 1
                closing = self._closing
                self._current = None if closing or job.cancelled.is_set() else job
            if self._current is None:
                self.counts["cancelled"] += 1
                job.post("error", _shutting_down() if closing else _cancelled())
                continue
            start = time.perf_counter()
            try:
                for r in job.requests:  # a prompt list's prompts, in order, until one fails or is cancelled
                    if not self._run(job, r):
                        break
            except Exception as e:  # a bug or the device: this request fails, the server goes on
                self.counts["failed"] += 1
                job.post("error", APIError(500, f"{type(e).__name__}: {e}", type="server_error"))
            finally:
                with self._lock:
                    self._current = None
                self._seconds = 0.8 * self._seconds + 0.2 * (time.perf_counter() - start)
        while True:  # shutting down: every request still queued gets its answer
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.post("error", _shutting_down())

    def _run(self, job: Job, r: Completion) -> bool:
        """Run one prompt of `job`, posting its events; False when it ended the job (an error, a cancel)."""
        from tokenizers.decoders import DecodeStream

        tok, gen = self.tokenizer, self.prefix.gen
        t0 = time.perf_counter()
        scored = r.echo and r.logprobs is not None
        try:  # echo with max_tokens 0 decodes one token, which the answer leaves out
            reuse, pieces = self.prefix.stream(r.prompt_ids, max(r.max_tokens, 1), temperature=r.temperature,
                                               top_k=r.top_k, top_p=r.top_p, seed=r.seed,
                                               stop_at_eos=not r.ignore_eos, repeat_penalty=r.repeat_penalty,
                                               min_p=r.min_p, presence_penalty=r.presence_penalty,
                                               frequency_penalty=r.frequency_penalty, logit_bias=r.logit_bias,
                                               logprobs=r.logprobs, prompt_logprobs=r.logprobs if scored else None,
                                               grammar=r.grammar)
        except (ValueError, TypeError) as e:  # checked on the HTTP side already; the generator has the last word
            job.post("error", APIError(400, str(e)))
            return False
        gen.stats = None
        stream, stops = DecodeStream(skip_special_tokens=True), StopStrings(r.stop)
        ids: list[int] = []
        shown: list[str] = []
        stopped = False
        eos = set() if r.ignore_eos else set(gen.eos_token_ids)
        t1 = t2 = t0
        at = len(r.echo_text)  # characters of the answer's text so far (the offset of the next token's)
        try:
            for piece in pieces:
                if not ids:
                    t1 = time.perf_counter()
                    if r.echo:
                        job.post("text", r.echo_text, _prompt_scores(tok, gen.prompt_logprobs))
                    if r.max_tokens == 0:
                        break
                t2 = time.perf_counter()
                if job.cancelled.is_set():
                    break
                out: list[str] = []
                scores: list[TokenScore] = []
                self.counts["decoded_tokens"] += len(piece)
                for item in piece:
                    t = item if isinstance(item, int) else item.token  # an id, or its logprob record
                    ids.append(t)
                    if not isinstance(item, int):  # every sampled token has its record, the EOS token's too
                        scores.append(TokenScore(item, at))
                    if t in eos:  # the reply's end (always its last token), not part of its text
                        continue
                    text = stream.step(tok, t)
                    if text:
                        at += len(text)
                        shown.append(text)
                        safe, stopped = stops.feed(text)
                        out.append(safe)
                        if stopped:
                            break
                if any(out) or scores:
                    job.post("text", "".join(out), scores)
                if stopped:
                    break
        finally:
            pieces.close()  # a request left early: the generator resets (the prefix cache keeps the prompt)
        if job.cancelled.is_set():
            self.counts["cancelled"] += 1
            job.post("error", _shutting_down() if self._closing else _cancelled())
            return False
        if not stopped:  # what DecodeStream still held (an incomplete character), as a full decode renders it
            text = tok.decode([t for t in ids if t not in eos], skip_special_tokens=True)
            done = "".join(shown)
            tail = text[len(done) :] if text.startswith(done) else ""
            safe, stopped = stops.feed(tail)
            if not stopped:
                safe += stops.flush()
            if safe:
                job.post("text", safe, [])
        finish = "stop" if stopped or (ids and ids[-1] in eos) else "length"
        s = gen.stats
        if s is not None:  # the run completed: the generator's own timings
            prefill_ms, per_token = 1e3 * s.prefill_s, s.ms_per_step
        else:  # ended at a stop string: the read-backs' times
            prefill_ms = 1e3 * (t1 - t0)
            per_token = 1e3 * (t2 - t1) / (len(ids) - 1) if len(ids) > 1 else 0.0
        self.counts["completed"] += 1
        job.post("done", finish, Usage(len(r.prompt_ids), len(ids), reuse.cached, prefill_ms, per_token))
        return True


def _prompt_scores(tok: Any, records: list | None) -> list[TokenScore]:
    """The prompt's records (None: not asked for) with each token's offset in the prompt's decoded text."""
    from tokenizers.decoders import DecodeStream

    stream, at, scores = DecodeStream(skip_special_tokens=True), 0, []
    for rec in records or []:
        scores.append(TokenScore(rec, at))
        at += len(stream.step(tok, rec.token) or "")
    return scores


def _cancelled() -> APIError:
    return APIError(499, "the client closed the request", type="cancelled", code="client_closed_request")


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
