"""The device-only step functions of generation, over static buffers the host fills.

Every step has the signature `fn(model, cache, bufs, read_len) -> None`: fixed shapes, one Python int
(`read_len`), no host reads, results written in place into `bufs` (so a CUDA-graph replay overwriting its
outputs can lose nothing). The capture layer compiles these functions unchanged, one graph per
(kind, read bucket); `STEPS` maps each kind to its function.

One request runs: `prefill` once per chunk of the prompts, then `first` (or `first_greedy`), then `decode`
(or `decode_greedy`) once per further token. The greedy kinds skip the sort and the noise; the host picks
them when every row of the request has temperature 0.

Token i of a row is written to out[b, i] by the step whose `bufs.step` counter is i. A row that emitted an EOS
id is `done`: later steps feed it nothing (n_new = 0, so its cache row and length stay put) and write PAD.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol

import torch

from static_decode import sampling
from static_decode.cache import StaticKVCache
from static_decode.model import Llama

PAD = -1  # written to out[b, i] for rows already done; never a token id


@dataclass
class StepBuffers:
    """Static device buffers of one Generator (allocated once; the host only fills them).

    B is the cache's batch (rows past a request's batch are kept `done` and fed nothing), C the chunk size,
    N the output capacity, D the model width, E the number of EOS ids (at least 1; -1 entries match nothing).
    """

    chunk: torch.Tensor  # [B, C] int64 prompt chunk, padded with id 0 past n_new
    n_new: torch.Tensor  # [B] int64 real tokens per row in `chunk`
    hidden: torch.Tensor  # [B, D] model dtype: final-normed hidden state of each row's last prompt token
    next: torch.Tensor  # [B, 1] int64 the token each row feeds at the next decode step
    done: torch.Tensor  # [B] bool the row emitted EOS (or is not part of the request)
    out: torch.Tensor  # [B, N] int64 emitted tokens, PAD where a row was already done
    step: torch.Tensor  # [] int64 index of the token the next first/decode step emits
    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, <= 0 = off
    top_p: torch.Tensor  # [B] float32, >= 1 = off
    seed: torch.Tensor  # [B] int64 per-row 32-bit seed (sampling.row_seed)
    eos: torch.Tensor  # [E] int64 EOS ids, -1 = unused entry

    @classmethod
    def allocate(
        cls,
        batch: int,
        chunk: int,
        capacity: int,
        width: int,
        eos_slots: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> StepBuffers:
        def z(*shape: int, dt: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt, device=device)

        return cls(
            chunk=z(batch, chunk),
            n_new=z(batch),
            hidden=z(batch, width, dt=dtype),
            next=z(batch, 1),
            done=z(batch, dt=torch.bool),
            out=z(batch, capacity),
            step=z(),
            temperature=z(batch, dt=torch.float32),
            top_k=z(batch),
            top_p=z(batch, dt=torch.float32),
            seed=z(batch),
            eos=z(max(eos_slots, 1)) - 1,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer by name (e.g. to mark them as static addresses for CUDA graphs)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def prefill_chunk(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
    """Run the model on `bufs.chunk`; keep each row's hidden state at its last real slot (if it has one)."""
    h = model.hidden_states(bufs.chunk, cache, bufs.n_new, read_len)  # [B, C, D]
    B, _, D = h.shape
    last = (bufs.n_new - 1).clamp(min=0)  # [B]
    h_last = h.gather(1, last[:, None, None].expand(B, 1, D)).squeeze(1)  # [B, D]
    bufs.hidden.copy_(torch.where(bufs.n_new[:, None] > 0, h_last, bufs.hidden))


def _emit(bufs: StepBuffers, token: torch.Tensor) -> None:
    """Record the token [B] chosen at step `bufs.step`: out, next, done, and the counter."""
    was_done = bufs.done
    index = bufs.step.view(1, 1).expand(token.shape[0], 1)  # [B, 1] device index, no host int
    bufs.out.scatter_(1, index, torch.where(was_done, PAD, token)[:, None])
    bufs.next.copy_(torch.where(was_done[:, None], bufs.next, token[:, None]))  # done rows keep a valid id
    bufs.done.copy_(was_done | (token[:, None] == bufs.eos[None, :]).any(dim=-1))
    bufs.step.add_(1)


def _choose(logits: torch.Tensor, bufs: StepBuffers) -> torch.Tensor:
    return sampling.sample(logits, bufs.temperature, bufs.top_k, bufs.top_p, bufs.seed, bufs.step)


def sample_first(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
    """Emit token 0 of every row from the kept prompt hidden state (cache and read_len unused)."""
    _emit(bufs, _choose(model.head(bufs.hidden), bufs))


def greedy_first(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
    """`sample_first` for an all-greedy request."""
    _emit(bufs, sampling.greedy(model.head(bufs.hidden)))


def decode_one(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
    """Feed each live row its next token, then sample and emit the following one."""
    n_new = (~bufs.done).to(torch.int64)  # [B] done rows append nothing
    logits = model.step(bufs.next, cache, n_new, read_len)[:, 0]  # [B, V]
    _emit(bufs, _choose(logits, bufs))


def greedy_one(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
    """`decode_one` for an all-greedy request."""
    n_new = (~bufs.done).to(torch.int64)  # [B]
    logits = model.step(bufs.next, cache, n_new, read_len)[:, 0]  # [B, V]
    _emit(bufs, sampling.greedy(logits))


StepFn = Callable[[Llama, StaticKVCache, StepBuffers, int], None]

STEPS: dict[str, StepFn] = {
    "prefill": prefill_chunk,
    "first": sample_first,
    "first_greedy": greedy_first,
    "decode": decode_one,
    "decode_greedy": greedy_one,
}
UNBUCKETED = ("first", "first_greedy")  # kinds that read no cache: always launched with read_len 0
GREEDY_KINDS = ("prefill", "first_greedy", "decode_greedy")  # what an all-greedy request launches
SAMPLED_KINDS = ("prefill", "first", "decode")  # what a request with temperature > 0 launches


class StepRunner(Protocol):
    """What the generator asks of a runner: the read length of a step and the callable of a step kind there.

    `EagerRunner` (here) is the default; `capture.CompiledRunner` compiles the same STEPS, one graph per
    (kind, read bucket)."""

    def read_len(self, longest: int) -> int:
        """The read length of a step whose longest row (after it) holds `longest` tokens."""
        ...

    def step(self, kind: str, read_len: int) -> StepFn:
        """The callable `fn(model, cache, bufs, read_len)` that runs step `kind` at `read_len`."""
        ...


class EagerRunner:
    """The uncompiled steps, each reading exactly the live length."""

    def read_len(self, longest: int) -> int:
        return longest

    def step(self, kind: str, read_len: int) -> StepFn:
        try:
            return STEPS[kind]
        except KeyError:
            raise KeyError(f"no step kind {kind!r}; the kinds are {tuple(STEPS)}") from None
