"""Structured output: a JSON schema (or any JSON object) compiled against a tokenizer, run on one of two paths.

- device: outlines-core compiles the schema's regular expression to a token-level automaton; its tables go to the
  step buffers (static_decode.steps.grammar) and the captured steps mask and advance it: no host sync per token.
- host: a grammar that is not regular (`json_object`: nesting of any depth), a schema outlines-core does not take,
  or an automaton larger than the generator's tables, runs xgrammar's matcher on the host (outlines-core unrolls a
  recursive `$ref` to depth 3, so such a schema stays on the device, nesting at most that deep): the generator
  reads back every step and writes the next step's mask (`bufs.grammar_allow`).

`Grammar` is compiled once per schema and tokenizer (it is the slow part) and reused by every request that names
it (SamplingParams(grammar=...)). Which library and why: docs/guide.md#structured-output.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from static_decode.generation import json_numbers
from static_decode.steps import grammar as tables
from static_decode.steps.grammar import TokenAutomaton
from static_decode.text.token_bytes import token_bytes

DEFAULT_GRAMMAR_TABLES = (1024, 1024)  # (states, token classes) of a Generator's grammar tables


class Grammar:
    """A constraint compiled for one vocabulary: `json_schema(schema, tokenizer)`, `json_object(tokenizer)` or
    `regex(pattern, tokenizer)`.

    `automaton` is the token-level automaton when the grammar is regular (the device path), else None; `why_host`
    then says why. vocab_size: the model's vocabulary (default: the tokenizer's; a model may pad it)."""

    def __init__(self, kind: str, schema: str | None, tokenizer: Tokenizer, vocab_size: int | None) -> None:
        self.kind, self.schema = kind, schema
        self._bytes = token_bytes(tokenizer)
        full = tokenizer.get_vocab_size(with_added_tokens=True)
        self.vocab_size = int(full if vocab_size is None else vocab_size)
        if self._bytes and max(self._bytes) >= self.vocab_size:
            raise ValueError(f"vocab_size={self.vocab_size} is smaller than the tokenizer's ids")
        self._transitions: tuple[dict, list[int], int] | None = None
        self.why_host: str | None = None
        self._automata: dict[tuple[int, ...], TokenAutomaton] = {}
        self._xgrammar: dict[tuple[int, ...], Any] = {}
        if kind == "json_object":
            self.why_host = "any JSON object nests to any depth: not a regular grammar"
        else:
            self._compile_automaton()

    @classmethod
    def json_schema(cls, schema: dict | str, tokenizer: Tokenizer, *, vocab_size: int | None = None) -> Grammar:
        """Output that is one JSON value valid under `schema` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema must be a JSON object (a schema), got {schema!r}")
        return cls("json_schema", json.dumps(schema), tokenizer, vocab_size)

    @classmethod
    def regex(cls, pattern: str, tokenizer: Tokenizer, *, vocab_size: int | None = None) -> Grammar:
        """Output that fully matches the regular expression `pattern` (outlines-core's syntax): a forced tool call,
        its arguments' part made of `args_regex` pieces."""
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"a grammar's regular expression must be a non-empty string, got {pattern!r}")
        return cls("regex", pattern, tokenizer, vocab_size)

    @staticmethod
    def args_regex(schema: dict) -> str:
        """The regular expression of one JSON value valid under `schema`, numbers bounded (json_numbers): what
        json_schema's device path runs, as a piece of a larger expression."""
        from outlines_core.json_schema import build_regex_from_schema

        text = json.dumps(schema)
        return json_numbers.cap_regex(build_regex_from_schema(text), text)

    @classmethod
    def json_object(cls, tokenizer: Tokenizer, *, vocab_size: int | None = None) -> Grammar:
        """Output that is one JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls("json_object", None, tokenizer, vocab_size)

    def _compile_automaton(self) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        try:
            regex = self.schema if self.kind == "regex" else json_numbers.cap_regex(
                build_regex_from_schema(self.schema), self.schema)
        except Exception as e:  # noqa: BLE001 (recursion, an unsupported keyword): the host grammar takes it
            self.why_host = f"outlines-core cannot make a regular expression of the schema ({e})"
            return
        vocab = {}
        for i, b in self._bytes.items():
            vocab.setdefault(b, []).append(i)
        eos = self.vocab_size  # no real token: EOS is the tables' own column (steps.grammar)
        index = outlines_core.Index(regex, outlines_core.Vocabulary(eos, vocab))
        transitions = {s: {t: n for t, n in edges.items() if t != eos} for s, edges in index.get_transitions().items()}
        self._transitions = (transitions, list(index.get_final_states()), index.get_initial_state())

    def automaton(self, eos_ids: Sequence[int]) -> TokenAutomaton | None:
        """The device tables' automaton with `eos_ids` allowed in accepting states (None: host path)."""
        if self._transitions is None:
            return None
        key = tuple(sorted(eos_ids))
        if key not in self._automata:
            transitions, final, initial = self._transitions
            self._automata[key] = TokenAutomaton.from_transitions(transitions, final, initial, self.vocab_size, key)
        return self._automata[key]

    def host_grammar(self, eos_ids: Sequence[int]) -> Any:
        """xgrammar's compiled grammar for this constraint (the host path)."""
        import xgrammar

        key = tuple(sorted(eos_ids))
        if key not in self._xgrammar:
            vocab = [self._bytes.get(i, b"") for i in range(self.vocab_size)]
            info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=self.vocab_size,
                                          stop_token_ids=list(key) or None)
            compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
            if self.kind == "regex":
                self._xgrammar[key] = compiler.compile_regex(self.schema)
            else:
                schema = self.schema if self.kind == "json_schema" else json.dumps({"type": "object"})
                ebnf = json_numbers.cap_ebnf(str(xgrammar.Grammar.from_json_schema(schema)), schema)
                self._xgrammar[key] = compiler.compile_grammar(ebnf)
        return self._xgrammar[key]


class DevicePath:
    """Rows on the device automaton; the host walks the same tables at read-backs to learn which rows ended."""

    path = "device"

    def __init__(self, automaton: TokenAutomaton, rows: int) -> None:
        self.automaton = automaton
        self.state = [automaton.initial] * rows

    def update(self, bufs: object, piece: list[list[int]], finished: np.ndarray) -> None:
        a = self.automaton
        for b, toks in enumerate(piece):
            for t in toks:
                if self.state[b] >= 0:
                    self.state[b] = a.advance(self.state[b], t)
            if self.state[b] < 0 or not a.live[self.state[b]]:
                finished[b] = True


class HostPath:
    """Rows under xgrammar's matcher on the host: a mask written before every step."""

    path = "host"

    def __init__(self, compiled: Any, bufs: object, rows: int, eos_ids: Sequence[int]) -> None:
        import xgrammar

        self.matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(rows)]
        self.V = bufs.grammar_allow.shape[1]
        self.bitmask = xgrammar.allocate_token_bitmask(1, self.V)
        self.eos = list(eos_ids)
        self._write(bufs, np.zeros(rows, dtype=bool))

    def _write(self, bufs: object, finished: np.ndarray) -> None:
        allow = np.ones(tuple(bufs.grammar_allow.shape), dtype=bool)  # [B, V]
        done = []
        for b, m in enumerate(self.matchers):
            if finished[b]:
                continue
            m.fill_next_token_bitmask(self.bitmask)
            bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), bitorder="little")[: self.V].astype(bool)
            if m.is_terminated() or not bits.any():
                done.append(b)
            allow[b] = bits
        bufs.grammar_allow.copy_(torch.from_numpy(allow).to(bufs.grammar_allow.device))
        for b in done:
            finished[b] = True
            bufs.done[b] = True

    def update(self, bufs: object, piece: list[list[int]], finished: np.ndarray) -> None:
        for b, toks in enumerate(piece):
            for t in toks:
                if not finished[b] and not self.matchers[b].accept_token(t):
                    finished[b] = True  # cannot happen under the mask; never feed the matcher past it
        self._write(bufs, finished)


def start(
    grammar: Grammar | None, bufs: object, rows: int, eos_ids: Sequence[int]
) -> DevicePath | HostPath | None:
    """Set up a request's constraint in the step buffers (rows 0..rows-1 constrained; none: every row free)."""
    if not tables.active(bufs):
        return None
    bufs.grammar_state.fill_(-1)
    bufs.grammar_allow.fill_(True)
    if grammar is None:
        return None
    a = grammar.automaton(eos_ids)
    S, C = bufs.grammar_next.shape
    if a is not None and a.states <= S and a.classes <= C:
        tables.load(bufs, a, rows)
        return DevicePath(a, rows)
    return HostPath(grammar.host_grammar(eos_ids), bufs, rows, eos_ids)


def why_host(grammar: Grammar, bufs: object, eos_ids: Sequence[int]) -> str | None:
    """Why a request with `grammar` takes the host path on these buffers (None: the device path)."""
    if grammar.why_host is not None:
        return grammar.why_host
    a = grammar.automaton(eos_ids)
    S, C = bufs.grammar_next.shape
    if a.states > S or a.classes > C:
        return f"the automaton's {a.states} states x {a.classes} token classes exceed the tables' {S} x {C}"
    return None
