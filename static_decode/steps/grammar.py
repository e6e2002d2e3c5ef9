"""Constrained decoding on the device: a token-level automaton's tables, the logit mask and the state advance.

A regular grammar compiled against a vocabulary is a deterministic automaton over tokens: per state, the tokens
allowed and the state each leads to. Tokens that behave alike in every state share a class, so the automaton is
two small tables: `token_class` [V] (the class of each token) and `next` [S, C] (the state a class leads to, -1:
not allowed). A row's state lives in `bufs.grammar_state` (-1: unconstrained); the step masks its logits with
`next[state, token_class] >= 0` and advances the state by the token it emitted, reading nothing back. EOS is a
class of its own, allowed (and leading nowhere) only in accepting states; a row whose state allows nothing ends.

Rows under a per-step host mask (a grammar that is not regular, or too large for the tables) keep state -1 and
are masked by `bufs.grammar_allow` [B, V], which the host writes before each step.
Design notes: docs/guide.md#structured-output.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

_HASH_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)


@dataclass(frozen=True)
class TokenAutomaton:
    """A deterministic automaton over token ids, as the device tables hold it (host numpy arrays).

    token_class [V] int32 (EOS ids: class C - 1), next [S, C] int32 (-1: not allowed; the EOS column holds the
    state itself in accepting states), accept [S] bool, live [S] bool (the state allows some token), initial."""

    token_class: np.ndarray
    next: np.ndarray
    accept: np.ndarray
    live: np.ndarray
    initial: int

    @property
    def states(self) -> int:
        return int(self.next.shape[0])

    @property
    def classes(self) -> int:
        return int(self.next.shape[1])

    def table_bytes(self) -> int:
        """Device bytes of these tables unpadded (int32 classes and next states, bool flags)."""
        return 4 * self.token_class.size + 4 * self.next.size + 2 * self.states

    def allowed(self, state: int) -> np.ndarray:
        """[V] bool: the tokens state `state` allows (EOS ids included where it accepts)."""
        return self.next[state, self.token_class] >= 0

    def advance(self, state: int, token: int) -> int:
        """The state after `token` (-1: not allowed there)."""
        return int(self.next[state, self.token_class[token]])

    @classmethod
    def from_transitions(
        cls,
        transitions: Mapping[int, Mapping[int, int]],
        accepting: Iterable[int],
        initial: int,
        vocab_size: int,
        eos_ids: Iterable[int],
    ) -> TokenAutomaton:
        """From an automaton's transitions (state -> {token id: next state}, e.g. outlines-core's
        `Index.get_transitions()`), its accepting states and its initial one. States are renumbered 0..S-1;
        tokens are grouped by their column (the next state in every state), hashed then checked exactly."""
        final = set(accepting)
        names = sorted(set(transitions) | final | {initial})
        pos = {s: k for k, s in enumerate(names)}
        S, V = len(names), vocab_size
        eos = sorted({int(e) for e in eos_ids if 0 <= e < V})
        rows: list[tuple[int, np.ndarray, np.ndarray]] = []
        h = np.zeros((2, V), dtype=np.uint64)  # a 128-bit hash of each token's column: (next state + 1) x weight
        weights = np.random.default_rng(_HASH_SEEDS[0]).integers(1, 2**63, size=(2, S), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for s, edges in transitions.items():
                ids = np.fromiter(edges.keys(), dtype=np.int64, count=len(edges))  # [n]
                to = np.fromiter((pos[t] for t in edges.values()), dtype=np.int64, count=len(edges))  # [n]
                if len(ids) and (ids.min() < 0 or ids.max() >= V):
                    raise ValueError(f"the automaton's state {s} names token ids outside 0..{V - 1}")
                keep = ~np.isin(ids, eos)  # EOS is the accepting states' own column, whatever the library gave
                ids, to = ids[keep], to[keep]
                rows.append((pos[s], ids, to))
                h[:, ids] += weights[:, pos[s], None] * (to + 1).astype(np.uint64)[None, :]  # [2, n]
            h[:, eos] = np.uint64(_HASH_SEEDS[1])  # EOS: a class of its own
            key = h[0] ^ (h[1] * np.uint64(3))  # [V]
        _, token_class = np.unique(key, return_inverse=True)
        token_class = token_class.astype(np.int32).reshape(V)  # [V]
        C = int(token_class.max()) + 1
        table = np.full((S, C), -1, dtype=np.int32)  # [S, C]
        for k, ids, to in rows:
            table[k, token_class[ids]] = to
            column = np.full(V, -1, dtype=np.int32)  # exact check: every token of a class has its class's column
            column[ids] = to
            column[eos] = -1
            got = table[k, token_class]
            got[eos] = -1
            if not np.array_equal(column, got):
                raise RuntimeError("token classes collided; the automaton's tables would be wrong")
        accept = np.zeros(S, dtype=bool)
        accept[[pos[s] for s in final]] = True
        if eos:
            table[:, token_class[eos[0]]] = np.where(accept, np.arange(S), -1)
        live = (table >= 0).any(axis=1)
        return cls(token_class=token_class, next=table, accept=accept, live=live, initial=pos[initial])


def load(bufs: object, automaton: TokenAutomaton, rows: int) -> None:
    """Copy `automaton` into the fixed-size tables of `bufs` (zero-padded: padding is never reached) and start
    rows 0..rows-1 at its initial state, the others unconstrained."""
    S, C = bufs.grammar_next.shape
    if automaton.states > S or automaton.classes > C:
        raise ValueError(f"the automaton has {automaton.states} states and {automaton.classes} token classes; "
                         f"the tables hold {S} and {C}")
    nxt = np.full((S, C), -1, dtype=np.int32)
    nxt[: automaton.states, : automaton.classes] = automaton.next
    live = np.zeros(S, dtype=bool)
    live[: automaton.states] = automaton.live
    device = bufs.grammar_next.device
    bufs.grammar_next.copy_(torch.from_numpy(nxt).to(device))
    bufs.grammar_live.copy_(torch.from_numpy(live).to(device))
    bufs.grammar_class.copy_(torch.from_numpy(automaton.token_class).to(device))
    state = np.full(bufs.grammar_state.shape[0], -1, dtype=np.int64)
    state[:rows] = automaton.initial
    bufs.grammar_state.copy_(torch.from_numpy(state).to(device))


def active(bufs: object) -> bool:
    """The buffers hold grammar tables (a shape: static in a trace)."""
    return bufs.grammar_next.shape[0] > 0


def mask(logits: torch.Tensor, bufs: object) -> torch.Tensor:
    """logits [B, V] with every token the row's grammar does not allow set to -inf (unconstrained rows: as they
    are, but for the host mask, which is all True for them)."""
    state = bufs.grammar_state  # [B]
    nxt = bufs.grammar_next[state.clamp(min=0)]  # [B, C]
    by_table = nxt.gather(1, bufs.grammar_class[None, :].expand(state.shape[0], -1).to(torch.int64)) >= 0  # [B, V]
    allowed = torch.where(state[:, None] >= 0, by_table, bufs.grammar_allow)  # [B, V]
    return logits.masked_fill(~allowed, float("-inf"))


def advance(bufs: object, token: torch.Tensor, emitted: torch.Tensor) -> torch.Tensor:
    """Move each constrained row that emitted (emitted [B] bool) by its token [B]; [B] bool: the rows whose new
    state allows nothing (they end)."""
    state = bufs.grammar_state  # [B]
    cls = bufs.grammar_class[token].to(torch.int64)  # [B]
    moved = bufs.grammar_next[state.clamp(min=0), cls].to(torch.int64)  # [B]
    go = emitted & (state >= 0)  # [B]
    new = torch.where(go, moved, state)  # [B]
    bufs.grammar_state.copy_(new)
    return go & ~bufs.grammar_live[new.clamp(min=0)]
