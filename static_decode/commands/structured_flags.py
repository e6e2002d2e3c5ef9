"""--json-schema FILE and --json-object (generate, chat): the reply is one JSON value valid under the schema in
FILE, or one JSON object. The file is read and checked before the model loads; the grammar is compiled against
the checkpoint's tokenizer once (static_decode.generation.structured; docs/guide.md#structured-output).
`generate` then prints the reply alone (no prompt before it) and neither command prints the EOS token (a
tokenizer may not mark it special), so the output is the JSON."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from typing import Any

from static_decode.generation.structured import DEFAULT_GRAMMAR_TABLES, Grammar


def add_structured_arguments(p: argparse.ArgumentParser) -> None:
    """The two flags, mutually exclusive."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain the output to one JSON value valid under the JSON schema in FILE")
    g.add_argument("--json-object", action="store_true", help="constrain the output to one JSON object")


def requested(args: argparse.Namespace) -> bool:
    return getattr(args, "json_schema", None) is not None or getattr(args, "json_object", False)


def read_schema(args: argparse.Namespace) -> dict[str, Any] | None:
    """The schema of --json-schema FILE (None without it), checked: a readable file holding a JSON object, and
    no speculation (--speculate / --draft-model)."""
    if not requested(args):
        return None
    flag = "--json-object" if args.json_schema is None else f"--json-schema {args.json_schema}"
    if getattr(args, "speculate", None) is not None or getattr(args, "draft_model", None) is not None:
        raise ValueError(f"{flag}: structured output is not supported with speculative decoding (--speculate)")
    try:
        import outlines_core  # noqa: F401
        import xgrammar  # noqa: F401
    except ModuleNotFoundError as e:
        raise ValueError(f"{flag} needs outlines-core and xgrammar (the [grammar] extra; {e.name} is missing): "
                         "pip install 'static-decode[grammar]'") from e
    if args.json_schema is None:
        return None
    try:
        with open(args.json_schema, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: cannot read the file: {e}") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: the file is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{flag}: a JSON schema is a JSON object, the file holds {type(schema).__name__} "
                         f"{json.dumps(schema)[:80]}")
    return schema


def grammar_tables(args: argparse.Namespace) -> tuple[int, int] | None:
    """The Generator's grammar_tables for these flags (None: no structured output)."""
    return DEFAULT_GRAMMAR_TABLES if requested(args) else None


def compile_grammar(args: argparse.Namespace, schema: dict[str, Any] | None, tokenizer: Any, vocab_size: int,
                    eos_ids: Sequence[int]) -> Grammar | None:
    """The flags' grammar for this tokenizer (None without them); a schema neither library compiles: ValueError."""
    if not requested(args):
        return None
    flag = "--json-object" if args.json_schema is None else f"--json-schema {args.json_schema}"
    if tokenizer is None:
        raise ValueError(f"{flag} needs a tokenizer.json in the checkpoint (the grammar is compiled against it)")
    try:
        if schema is None:
            grammar = Grammar.json_object(tokenizer, vocab_size=vocab_size)
        else:
            grammar = Grammar.json_schema(schema, tokenizer, vocab_size=vocab_size)
        if grammar.why_host is not None:  # the host grammar, compiled now rather than at the first token
            grammar.host_grammar(eos_ids)
    except Exception as e:  # noqa: BLE001 - whatever the compilers refuse is the schema's fault
        raise ValueError(f"{flag}: the schema cannot be compiled: {type(e).__name__}: {e}") from e
    return grammar


def without_eos(tokens: Iterator[int], eos_ids: Sequence[int]) -> Iterator[int]:
    """`tokens` less the EOS ids (the server's replies leave them out too); closing it closes `tokens`."""
    eos = set(eos_ids)
    try:
        for t in tokens:
            if t not in eos:
                yield t
    finally:
        close = getattr(tokens, "close", None)
        if close is not None:
            close()
