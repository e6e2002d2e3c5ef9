"""A request's `response_format` (OpenAI's structured output), checked and compiled for `serve --structured`.

{"type": "text"} (or none): free text. {"type": "json_object"}: one JSON object (xgrammar's mask on the host).
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}: one JSON value valid under `schema` (the
device automaton when outlines-core makes one that fits the tables, else the host mask). Each distinct schema is
compiled once, keyed by its canonical JSON, and kept in a small LRU cache; a schema neither library compiles is a
400 naming response_format. Paths and costs: docs/guide.md#structured-output.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from static_decode.generation.structured import Grammar

CACHED_SCHEMAS = 16  # compiled grammars kept (least recently used dropped first)


class FormatError(ValueError):
    """A response_format this server refuses (a 400 naming the field)."""


class GrammarCache:
    """The served tokenizer's compiled grammars: json_object once, each schema once (keyed by canonical JSON), each
    forced tool call's regular expression once."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int], size: int = CACHED_SCHEMAS) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids, self.size = tokenizer, vocab_size, list(eos_ids), size
        self._grammars: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled so far (a cache hit compiles none)

    def get(self, schema: dict[str, Any] | None) -> Grammar:
        """The grammar of `schema` (None: any JSON object), compiled at its first request."""
        key = "" if schema is None else json.dumps(schema, sort_keys=True, separators=(",", ":"))
        return self._cached(key, lambda: self._compile(schema))

    def regex(self, pattern: str) -> Grammar:
        """The grammar of a regular expression (a forced tool call), compiled at its first request."""

        def compile_regex() -> Grammar:
            try:
                grammar = Grammar.regex(pattern, self.tokenizer, vocab_size=self.vocab_size)
                if grammar.why_host is not None:
                    grammar.host_grammar(self.eos_ids)
            except Exception as e:  # noqa: BLE001 - whatever the compilers refuse is the tools' fault
                raise FormatError(f"the forced call's grammar cannot be compiled: {type(e).__name__}: {e}") from e
            return grammar

        return self._cached("regex:" + pattern, compile_regex)

    def _cached(self, key: str, compile_it: Any) -> Grammar:
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
            grammar = compile_it()
            self._grammars[key] = grammar
            self.compiled += 1
            while len(self._grammars) > self.size:
                self._grammars.popitem(last=False)
            return grammar

    def _compile(self, schema: dict[str, Any] | None) -> Grammar:
        try:
            if schema is None:
                grammar = Grammar.json_object(self.tokenizer, vocab_size=self.vocab_size)
            else:
                grammar = Grammar.json_schema(schema, self.tokenizer, vocab_size=self.vocab_size)
            if grammar.why_host is not None:  # the host path's grammar, compiled now so a failure is this request's
                grammar.host_grammar(self.eos_ids)
        except Exception as e:  # noqa: BLE001 - whatever the compilers refuse is the schema's fault
            raise FormatError(f"response_format: the schema cannot be compiled: {type(e).__name__}: {e}") from e
        return grammar


def _shown(v: Any) -> str:
    try:
        return json.dumps(v)[:120]
    except (TypeError, ValueError):
        return repr(v)[:120]


def response_format(body: dict[str, Any], grammars: GrammarCache | None, speculating: bool) -> Grammar | None:
    """The grammar a request's `response_format` asks for (None: free text), or a FormatError saying why not."""
    v = body.get("response_format")
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise FormatError(f"response_format must be an object with a type (text, json_object or json_schema), "
                          f"got {_shown(v)}")
    kind = v["type"]
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise FormatError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
    if speculating:
        raise FormatError(f"response_format {kind} is not supported by this server, which decodes speculatively "
                          f"(--speculate); leave it out or set it to {{\"type\": \"text\"}}")
    if grammars is None:
        raise FormatError(f"response_format is not supported by this server (got {_shown(v)}): start it with "
                          f"`serve --structured`, or leave it out or set it to {{\"type\": \"text\"}}")
    if kind == "json_object":
        return grammars.get(None)
    spec = v.get("json_schema")
    if not isinstance(spec, dict):
        raise FormatError(f"response_format json_schema needs json_schema: {{\"name\", \"schema\"}}, got "
                          f"{_shown(spec)}")
    if not isinstance(spec.get("name", ""), str):
        raise FormatError(f"response_format json_schema.name must be a string, got {_shown(spec['name'])}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise FormatError(f"response_format json_schema.strict must be a boolean, got {_shown(spec['strict'])}")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise FormatError(f"response_format json_schema.schema must be a JSON schema (an object), got "
                          f"{_shown(schema)}")
    return grammars.get(schema)
