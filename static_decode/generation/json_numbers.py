"""JSON numbers of bounded length in the structured-output grammars, as llama.cpp's schema grammar bounds them.

A schema's `integer` or `number` without bounds lets a model write digits until max_tokens cuts the reply (invalid
JSON, finish_reason "length"). llama.cpp's json-schema-to-grammar caps them, and so does this: an integer part of at
most MAX_DIGITS digits (`0`, or a non-zero digit and up to 15 more), a fraction of 1 to MAX_DIGITS digits, an
exponent of 1 to MAX_DIGITS digits. Every number within the cap is still allowed. Applied to both paths'
grammars: outlines-core's regular expression (the device automaton) and xgrammar's EBNF (the host matcher).
"""

from __future__ import annotations

MAX_DIGITS = 16  # llama.cpp's: integral part [1-9][0-9]{0,15}, decimal part [0-9]{1,16}

# outlines-core's pieces of its INTEGER and NUMBER expressions (outlines_core.json_schema), and the capped ones
_REGEX = (
    ("(0|[1-9][0-9]*)", f"(0|[1-9][0-9]{{0,{MAX_DIGITS - 1}}})"),
    (r"(\.[0-9]+)", rf"(\.[0-9]{{1,{MAX_DIGITS}}})"),
    ("([eE][+-][0-9]+)", f"([eE][+-][0-9]{{1,{MAX_DIGITS}}})"),
)
# xgrammar's basic integer / number rules (Grammar.from_json_schema's EBNF), and the capped ones
_EBNF = (
    ("[1-9] [0-9]*", f"[1-9] [0-9]{{0,{MAX_DIGITS - 1}}}"),
    ("basic_number_digits{1, -1}", f"basic_number_digits{{1, {MAX_DIGITS}}}"),
)


def cap_regex(regex: str, schema: str) -> str:
    """outlines-core's regular expression for `schema` (its JSON text) with every unbounded number capped. A schema
    whose own text holds one of the replaced pieces (in a `pattern`) is left as it is: its pattern means what it
    says."""
    if any(old in schema for old, _ in _REGEX):
        return regex
    for old, new in _REGEX:
        regex = regex.replace(old, new)
    return regex


def cap_ebnf(ebnf: str, schema: str) -> str:
    """xgrammar's EBNF for `schema` (its JSON text) with every unbounded number capped (as cap_regex)."""
    if any(old in schema for old, _ in _EBNF):
        return ebnf
    for old, new in _EBNF:
        ebnf = ebnf.replace(old, new)
    return ebnf
