"""JSON numbers of bounded length (static_decode.generation.json_numbers), as llama.cpp's schema grammar bounds them.

Pins: on both grammars (outlines-core's regular expression for the device, xgrammar's EBNF for the host) an integer
part of up to 16 digits, a fraction and an exponent of up to 16, are accepted and one more digit is not, where the
uncapped grammar took it; a schema whose own pattern holds the replaced text is left as written; a model pushed to
write digits ends its integer at the 16th, on the device path and on the host path (json_object), where before it
wrote digits until max_tokens.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar
from outlines_core.json_schema import build_regex_from_schema
from xgrammar.testing import _is_grammar_accept_string

from static_decode import Generator, Llama, LlamaConfig
from static_decode.generation import json_numbers
from static_decode.generation.structured import DEFAULT_GRAMMAR_TABLES, Grammar
from tests.support.checkpoints import byte_tokenizer

D16, D17 = "1234567890123456", "12345678901234567"
CASES = [  # (schema, text, accepted once capped)
    ({"type": "integer"}, D16, True), ({"type": "integer"}, "-" + D16, True), ({"type": "integer"}, D17, False),
    ({"type": "integer"}, "0", True), ({"type": "number"}, "0." + D16, True), ({"type": "number"}, "0." + D17, False),
    ({"type": "number"}, f"-{D16}.5e+{D16}", True), ({"type": "number"}, f"1e-{D17}", False),
    ({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}, f'{{"n": {D16}}}', True),
    ({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}, f'{{"n": {D17}}}', False),
]


@pytest.mark.parametrize(("schema", "text", "ok"), CASES)
def test_the_device_regex_caps_numbers(schema, text, ok):
    s = json.dumps(schema)
    plain = build_regex_from_schema(s)
    assert re.fullmatch(plain, text)  # uncapped, every case is valid
    assert bool(re.fullmatch(json_numbers.cap_regex(plain, s), text)) == ok


@pytest.mark.parametrize(("schema", "text", "ok"), CASES)
def test_the_host_grammar_caps_numbers(schema, text, ok):
    s = json.dumps(schema)
    plain = str(xgrammar.Grammar.from_json_schema(s, any_whitespace=False))
    assert _is_grammar_accept_string(xgrammar.Grammar.from_ebnf(plain), text)
    capped = xgrammar.Grammar.from_ebnf(json_numbers.cap_ebnf(plain, s))
    assert _is_grammar_accept_string(capped, text) == ok


def test_a_pattern_holding_the_replaced_text_is_left_as_written():
    schema = json.dumps({"type": "object", "properties": {"id": {"type": "string", "pattern": "(0|[1-9][0-9]*)"},
                                                          "n": {"type": "integer"}}})
    regex = build_regex_from_schema(schema)
    assert json_numbers.cap_regex(regex, schema) == regex


@pytest.mark.parametrize("tables", [DEFAULT_GRAMMAR_TABLES, (4, 4)], ids=["device", "host"])
def test_a_model_pushed_to_digits_stops_at_the_cap(tables):
    """A random model whose logits favour "9" by 100, under {"type": "integer"}: it writes 16 nines, then EOS, on
    the device automaton and on the host matcher (the automaton does not fit tables of 4 states)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                              num_kv_heads=2))
    gen = Generator(model, max_len=128, eos_token_ids=[0], grammar_tables=tables)
    g = Grammar.json_schema({"type": "integer"}, byte_tokenizer())
    out = gen.generate([1, 2, 3], 40, grammar=g, logit_bias=[(ord("9"), 100.0)])
    assert (gen.structured_why is None) == (tables == DEFAULT_GRAMMAR_TABLES), gen.structured_why
    assert bytes(out[:-1]).decode() == "9" * 16 and out[-1] == 0
