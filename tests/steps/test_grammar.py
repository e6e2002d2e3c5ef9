"""Structured output on the device (static_decode.steps.grammar) and its host fallback.

- the device tables' mask equals outlines-core's own allowed tokens at every step of random walks (exact), on a
  byte vocabulary and on SmolLM2's 49,152-token BPE when /tmp/smollm2 exists;
- a tiny random model constrained to a schema emits JSON that parses and validates (jsonschema) for 20 seeds at
  temperature 0.8; json_object output (the host path) parses as an object;
- seeded eager == compiled (dynamo fullgraph: a host read inside a step would fail the trace);
- the device path reads back no more often than free decoding (the one read-back every read_every steps).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import outlines_core
import pytest
import torch
from outlines_core.json_schema import build_regex_from_schema
from tokenizers import Tokenizer

from static_decode import Generator, Llama, LlamaConfig
from static_decode.generation import host_loop as generator_module  # the host loop reads the rows back
from static_decode.generation.structured import DEFAULT_GRAMMAR_TABLES, Grammar
from static_decode.steps import grammar
from static_decode.steps.functions import StepBuffers
from static_decode.text.token_bytes import token_bytes
from tests.support.checkpoints import byte_tokenizer
from tests.support.compiled_cases import SYMBOLIC_EAGER, lazy

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "size": {"enum": ["s", "m", "l"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "ok", "size"],
    "additionalProperties": False,
}
EOS = 0
SMOLLM2 = Path("/tmp/smollm2/tokenizer.json")


@pytest.fixture(scope="module")
def tiny() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2))


@pytest.fixture(scope="module")
def schema_grammar() -> Grammar:
    return Grammar.json_schema(SCHEMA, byte_tokenizer())


def _index(tok: Tokenizer, eos: int) -> outlines_core.Index:
    """outlines-core's own Index of SCHEMA (the reference), EOS `eos` outside the vocabulary it is given."""
    vocab: dict[bytes, list[int]] = {}
    for i, b in token_bytes(tok).items():
        if i != eos:
            vocab.setdefault(b, []).append(i)
    return outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA)), outlines_core.Vocabulary(eos, vocab))


@pytest.mark.parametrize("which", ["bytes", "smollm2"])
def test_device_mask_equals_the_library_at_every_step(which):
    if which == "smollm2" and not SMOLLM2.exists():
        pytest.skip("SmolLM2's tokenizer is made by profiles/smollm2.py --out /tmp/smollm2")
    tok = byte_tokenizer() if which == "bytes" else Tokenizer.from_file(str(SMOLLM2))
    eos = EOS if which == "bytes" else 2
    V = tok.get_vocab_size(with_added_tokens=True)
    index = _index(tok, eos)
    g = Grammar.json_schema(SCHEMA, tok)
    a = g.automaton([eos])
    bufs = StepBuffers.allocate(1, 1, 4, 8, 1, dtype=torch.float32, device=torch.device("cpu"), vocab=V,
                                grammar=(a.states, a.classes))
    grammar.load(bufs, a, 1)
    rng = np.random.default_rng(1)
    for _ in range(20):
        grammar.load(bufs, a, 1)
        state = index.get_initial_state()
        for _step in range(60):
            want = np.zeros(V, dtype=bool)
            want[[t for t in index.get_allowed_tokens(state) if t != eos]] = True
            want[eos] = index.is_final_state(state)
            got = torch.isfinite(grammar.mask(torch.zeros(1, V), bufs))[0].numpy()  # [V]
            np.testing.assert_array_equal(got, want)
            choices = np.flatnonzero(want & (np.arange(V) != eos))
            if not len(choices):
                break
            t = int(rng.choice(choices))
            ended = grammar.advance(bufs, torch.tensor([t]), torch.tensor([True]))  # [1]
            state = index.get_next_state(state, t)
            assert bool(ended[0]) == (not index.get_allowed_tokens(state))  # ends where nothing is allowed


def test_tables_are_compact(schema_grammar):
    a = schema_grammar.automaton([EOS])
    assert a.next.shape == (a.states, a.classes) and a.classes < 256
    assert a.table_bytes() == 4 * 256 + 4 * a.states * a.classes + 2 * a.states
    assert a.accept.any() and a.live[a.initial]


def _text(out: list[int]) -> str:
    assert out and out[-1] == EOS, f"the row did not end at EOS: {out}"
    return bytes(out[:-1]).decode()


def test_schema_output_validates_for_20_seeds(tiny, schema_grammar):
    gen = Generator(tiny, max_len=256, eos_token_ids=[EOS], grammar_tables=DEFAULT_GRAMMAR_TABLES)
    for seed in range(20):
        out = gen.generate([1, 2, 3], 200, temperature=0.8, seed=seed, grammar=schema_grammar)
        assert gen.structured_path == "device" and gen.structured_why is None
        jsonschema.validate(json.loads(_text(out)), SCHEMA)


def test_batch_rows_each_follow_the_grammar(tiny, schema_grammar):
    gen = Generator(tiny, max_len=256, eos_token_ids=[EOS], grammar_tables=DEFAULT_GRAMMAR_TABLES)
    outs = gen.generate([[1, 2, 3], [7], [9, 9]], 200, temperature=0.8, seed=4, grammar=schema_grammar)
    for out in outs:
        jsonschema.validate(json.loads(_text(out)), SCHEMA)
    free = gen.generate([1, 2, 3], 30, temperature=0.8, seed=4, stop_at_eos=False)  # free again
    assert gen.structured_path is None and len(free) == 30


def test_json_object_takes_the_host_path_and_parses(tiny):
    g = Grammar.json_object(byte_tokenizer())
    gen = Generator(tiny, max_len=256, eos_token_ids=[EOS], grammar_tables=DEFAULT_GRAMMAR_TABLES)
    close = {ord("}"): 8.0, EOS: 8.0}  # the bias is added under the mask: it only hurries the object's end
    for seed in range(5):
        out = gen.generate([1, 2, 3], 200, temperature=0.8, seed=seed, grammar=g, logit_bias=close)
        assert gen.structured_path == "host" and "regular" in gen.structured_why
        assert isinstance(json.loads(_text(out)), dict)


def test_tables_too_small_fall_back_to_the_host(tiny, schema_grammar):
    gen = Generator(tiny, max_len=256, eos_token_ids=[EOS], grammar_tables=(4, 4))
    out = gen.generate([1, 2, 3], 200, temperature=0.8, seed=3, grammar=schema_grammar)
    assert gen.structured_path == "host" and "exceed the tables' 4 x 4" in gen.structured_why
    jsonschema.validate(json.loads(_text(out)), SCHEMA)


def test_refusals_name_the_value(tiny, schema_grammar):
    with pytest.raises(ValueError, match="grammar_tables"):
        Generator(tiny, max_len=64, eos_token_ids=[EOS]).generate([1], 4, grammar=schema_grammar)
    with pytest.raises(TypeError, match="grammar must be"):
        Generator(tiny, max_len=64, grammar_tables=(8, 8)).generate([1], 4, grammar=SCHEMA)
    other = Grammar.json_schema(SCHEMA, byte_tokenizer(), vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300"):
        Generator(tiny, max_len=64, grammar_tables=(8, 8)).generate([1], 4, grammar=other)
    with pytest.raises(ValueError, match="json_schema is not JSON"):
        Grammar.json_schema("{nope", byte_tokenizer())


def test_seeded_eager_equals_compiled(tiny, schema_grammar):
    # No EOS ids: a row ends where its text is complete and allows nothing more.
    eager = Generator(tiny, max_len=64, chunk_size=8, eos_token_ids=[], grammar_tables=(256, 128))
    compiled = lazy(tiny, (32, 64), settings=SYMBOLIC_EAGER, grammar_tables=(256, 128))
    for seed in range(3):
        want = eager.generate([1, 2, 3], 50, temperature=0.8, seed=seed, grammar=schema_grammar)
        got = compiled.generate([1, 2, 3], 50, temperature=0.8, seed=seed, grammar=schema_grammar)
        assert got == want and compiled.structured_path == "device"
        if len(want) < 50:
            jsonschema.validate(json.loads(bytes(want).decode()), SCHEMA)


def test_device_path_reads_back_only_every_read_every_steps(tiny, schema_grammar, monkeypatch):
    reads = []
    real = generator_module.read_rows

    def counted(bufs, stop, *a):
        reads.append(stop)
        return real(bufs, stop, *a)

    monkeypatch.setattr(generator_module, "read_rows", counted)
    gen = Generator(tiny, max_len=256, eos_token_ids=[], grammar_tables=DEFAULT_GRAMMAR_TABLES, read_every=16)
    lenient = Grammar.json_schema({"type": "string"}, byte_tokenizer())
    no_quote = {ord('"'): -100.0}  # the string never closes (its opening quote, the one token allowed, still comes)
    gen.generate([1, 2, 3], 64, temperature=0.8, seed=0, grammar=lenient, logit_bias=no_quote)
    constrained = list(reads)
    reads.clear()
    gen.generate([1, 2, 3], 64, temperature=0.8, seed=0, logit_bias=no_quote)
    assert constrained == reads and len(reads) == 5  # steps 0, 16, 32, 48 and the last
    if torch.cuda.is_available():  # on a GPU: no synchronising call between read-backs
        from capture.guards import no_host_sync

        with no_host_sync():
            grammar.mask(torch.zeros(1, 256, device="cuda"), StepBuffers.allocate(
                1, 1, 4, 8, 1, dtype=torch.float32, device=torch.device("cuda"), vocab=256, grammar=(4, 4)))
