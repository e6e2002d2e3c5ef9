"""Token logprobs computed inside the steps, read back with the tokens.

The reference is transformers' own model that wrote the checkpoint (float32): its full-sequence logits over the
prompt and the emitted tokens, log_softmax'd. Pins: greedy, each emitted token's logprob equals the reference at
its position within 1e-4, its top alternatives are torch.topk of the reference (ids exactly, values within 1e-4)
and the first of them is the token; ragged rows each match their own reference; a sampled request with a logit
bias and penalties reports the model's raw distribution, not the adjusted one; prompt logprobs over several
chunks match the reference at every prompt token (the first has none) and their mean NLL equals `perplexity`'s
on the same ids within 1e-4; prompt-lookup speculation reports the same records as plain decode; compiled steps
(inductor) give the eager records; a request asking for logprobs the generator does not keep is refused by name
before anything is allocated; the buffers' bytes are counted exactly; the top-k record is written in place in the
compiled step (no copy of the [B, N + 1, K] buffers in its generated code); a prefix-cache request with prompt
logprobs prefills its whole prompt.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from capture import CaptureOptions
from static_decode import Generator, load_model
from static_decode.commands.perplexity import perplexity
from static_decode.generation import memory
from static_decode.generation.conversation import Conversation
from static_decode.generation.prefix_cache import PrefixCache
from static_decode.steps import functions as steps
from static_decode.steps.logprobs import TokenLogprob
from static_decode.steps.speculation import PromptLookup
from tests.support.checkpoints import hf_llama, hf_logits, prompt, save

K = 5
PROMPT = [5, 17, 33, 2, 90, 61, 7, 5, 17, 3, 40, 8, 8, 71]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' model, ours loaded from its checkpoint), float32."""
    hf = hf_llama(seed=7)
    return hf, load_model(save(hf, tmp_path_factory.mktemp("logprobs") / "m"), dtype=torch.float32)


def reference(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float32 log_softmax of transformers' logits: row i scores the token at i + 1."""
    return hf_logits(hf, ids).log_softmax(dim=-1)


def check_records(ref: torch.Tensor, start: int, recs: list[TokenLogprob], k: int) -> None:
    """recs[i] scores the token at position start + i under ref[start + i - 1]."""
    for i, r in enumerate(recs):
        row = ref[start + i - 1]  # [V]
        assert r.logprob == pytest.approx(float(row[r.token]), abs=1e-4), (i, r)
        values, ids = row.topk(k)
        assert [t for t, _ in r.top] == ids.tolist(), (i, r.top)
        np.testing.assert_allclose([v for _, v in r.top], values.numpy(), atol=1e-4)


def test_greedy_logprobs_equal_transformers(pair):
    hf, model = pair
    gen = Generator(model, max_len=64, chunk_size=8, eos_token_ids=[], max_logprobs=K)
    recs = gen.generate(PROMPT, 12, logprobs=K)
    ids = [r.token for r in recs]
    assert ids == gen.generate(PROMPT, 12)  # the records' tokens are the plain request's
    assert all(r.top[0][0] == r.token for r in recs)  # greedy: the best alternative is the token
    check_records(reference(hf, PROMPT + ids), len(PROMPT), recs, K)
    fewer = gen.generate(PROMPT, 12, logprobs=2)  # k is a slice of the same buffers
    assert [r.top for r in fewer] == [r.top[:2] for r in recs]
    assert [r.logprob for r in gen.generate(PROMPT, 12, logprobs=0)] == [r.logprob for r in recs]
    assert all(r.top == () for r in gen.generate(PROMPT, 3, logprobs=0))


def test_ragged_rows_each_match_their_reference(pair):
    hf, model = pair
    gen = Generator(model, max_len=64, chunk_size=4, eos_token_ids=[], max_logprobs=K, read_every=3)
    rows = [PROMPT, prompt(5, seed=1), prompt(9, seed=2)]
    out = gen.generate(rows, 10, logprobs=3)
    for row, recs in zip(rows, out, strict=True):
        check_records(reference(hf, row + [r.token for r in recs]), len(row), recs, 3)


def test_streamed_records_are_the_generated_ones(pair):
    _, model = pair
    gen = Generator(model, max_len=64, chunk_size=8, eos_token_ids=[], max_logprobs=K, read_every=4)
    assert list(gen.stream(PROMPT, 9, logprobs=K)) == gen.generate(PROMPT, 9, logprobs=K)


def test_sampled_logprobs_are_the_models_raw_distribution(pair):
    """A logit bias, a repetition and a frequency penalty and a temperature change what is drawn, not the reported
    logprob: log_softmax of the model's own logits (vLLM's default)."""
    hf, model = pair
    gen = Generator(model, max_len=64, chunk_size=8, eos_token_ids=[], max_logprobs=K)
    options = dict(temperature=1.3, top_k=20, seed=11, logit_bias={4: 5.0, 9: -3.0}, repeat_penalty=1.5,
                   frequency_penalty=0.7)
    recs = gen.generate(PROMPT, 10, logprobs=K, **options)
    ids = [r.token for r in recs]
    assert ids == gen.generate(PROMPT, 10, **options)
    check_records(reference(hf, PROMPT + ids), len(PROMPT), recs, K)


def test_prompt_logprobs_equal_transformers_and_perplexity(pair):
    hf, model = pair
    ids = prompt(40, seed=3)
    gen = Generator(model, max_len=64, chunk_size=8, long_chunk=16, eos_token_ids=[], max_logprobs=K)
    out = gen.generate(ids, 2, prompt_logprobs=K)  # 40 tokens: five scored chunks (long chunks skipped)
    assert isinstance(out[0], int)  # logprobs not asked: the new tokens stay ids
    recs = gen.prompt_logprobs
    assert [r.token for r in recs] == ids and recs[0] == TokenLogprob(ids[0], None)
    check_records(reference(hf, ids), 1, recs[1:], K)
    nll = -np.mean([r.logprob for r in recs[1:]])
    assert nll == pytest.approx(perplexity(model, ids, 16).nll, abs=1e-4)
    ce = torch.nn.functional.cross_entropy(hf_logits(hf, ids)[:-1], torch.tensor(ids[1:]))
    assert nll == pytest.approx(float(ce), abs=1e-4)
    assert gen.generate(ids, 2) == out  # the scored prefill fed the cache as the plain one does
    batch = gen.generate([ids[:13], ids[:6]], 3, logprobs=1, prompt_logprobs=1)
    for row, got in zip([ids[:13], ids[:6]], gen.prompt_logprobs, strict=True):
        check_records(reference(hf, row), 1, got[1:], 1)
    assert len(batch) == 2


def test_prompt_lookup_speculation_reports_the_plain_records(pair):
    _, model = pair
    text = [3, 9, 27, 4, 3, 9, 27, 4, 3, 9]
    plain = Generator(model, max_len=64, chunk_size=8, eos_token_ids=[], max_logprobs=K)
    spec = Generator(model, max_len=64, chunk_size=8, eos_token_ids=[], max_logprobs=K,
                     speculate=PromptLookup(tokens=3, skip_unmatched=False))
    want = plain.generate(text, 12, logprobs=K)
    got = spec.generate(text, 12, logprobs=K)
    assert spec.stats.verify_steps > 0
    assert [r.token for r in got] == [r.token for r in want]
    for a, b in zip(got, want, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_compiled_records_equal_eager(pair):
    _, model = pair
    log = logging.getLogger("torch.__trace")  # as tests/capture/test_capture.py: keeps compile time down
    saved, log.propagate = log.propagate, False
    torch._dynamo.reset()
    try:
        opts = CaptureOptions(kinds=steps.GREEDY_KINDS, warm_up="lazy", progress=False)
        compiled = Generator(model, max_len=64, chunk_size=8, eos_token_ids=[], max_logprobs=K, compile=True,
                             capture=opts)
        got = compiled.generate(PROMPT, 10, logprobs=K, prompt_logprobs=K)
        got_prompt = compiled.prompt_logprobs
        # the token steps compiled; the scored prefill runs uncompiled (steps.prefill_scored)
        assert {r.kind for r in compiled.capture_records} == {"first_greedy", "decode_greedy"}
        assert all(r.fallback == "" for r in compiled.capture_records)
    finally:
        log.propagate = saved
        torch._dynamo.reset()
    eager = Generator(model, max_len=64, chunk_size=8, eos_token_ids=[], max_logprobs=K)
    want = eager.generate(PROMPT, 10, logprobs=K, prompt_logprobs=K)
    assert [r.token for r in got] == [r.token for r in want]
    for a, b in zip([*got_prompt, *got], [*eager.prompt_logprobs, *want], strict=True):
        assert (a.logprob is None) == (b.logprob is None)
        if a.logprob is not None:
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_logprobs_the_generator_does_not_keep_are_refused_first(pair):
    _, model = pair
    off = Generator(model, max_len=32, eos_token_ids=[])
    with pytest.raises(ValueError, match=r"logprobs=2 needs a generator that keeps logprobs.*max_logprobs"):
        off.generate(PROMPT, 3, logprobs=2)
    assert off.cache is None  # refused before anything was allocated
    small = Generator(model, max_len=32, eos_token_ids=[], max_logprobs=3)
    with pytest.raises(ValueError, match="prompt_logprobs=4 exceeds this generator's max_logprobs=3"):
        small.generate(PROMPT, 3, prompt_logprobs=4)
    assert small.cache is None
    with pytest.raises(ValueError, match="logprobs must be an int >= 0, got -1"):
        small.generate(PROMPT, 3, logprobs=-1)
    with pytest.raises(TypeError, match="logprobs must be an int"):
        small.generate(PROMPT, 3, logprobs=True)
    with pytest.raises(ValueError, match="max_logprobs must be an int >= 0"):
        Generator(model, max_len=32, max_logprobs=-1)
    with pytest.raises(ValueError, match="not supported on a Conversation"):
        Conversation(small).send(PROMPT, 3, logprobs=1)


def test_prefix_cache_scores_the_whole_prompt(pair):
    hf, model = pair
    gen = Generator(model, max_len=64, chunk_size=8, eos_token_ids=[], max_logprobs=K, batch=1)
    cache = PrefixCache(gen)
    _, pieces = cache.stream(PROMPT, 4)
    list(pieces)
    reuse, pieces = cache.stream(PROMPT + [9, 9], 3, prompt_logprobs=2, logprobs=2)
    got = [r for piece in pieces for r in piece]
    assert reuse.cached == 0 and len(gen.prompt_logprobs) == len(PROMPT) + 2
    check_records(reference(hf, PROMPT + [9, 9]), 1, gen.prompt_logprobs[1:], 2)
    check_records(reference(hf, PROMPT + [9, 9] + [r.token for r in got]), len(PROMPT) + 2, got, 2)
    assert cache.tokens == PROMPT + [9, 9] + [r.token for r in got][:-1]  # the cached sequence is of ids
    reuse, pieces = cache.stream(PROMPT + [9, 9, 1], 2)
    list(pieces)
    assert reuse.cached == len(PROMPT) + 2  # a plain request reuses the scored one's prompt


@pytest.mark.parametrize("k", [0, 3])
def test_buffer_bytes_are_counted_exactly(pair, k):
    _, model = pair
    gen = Generator(model, max_len=40, chunk_size=5, batch=2, max_logprobs=k)
    want = memory.generation_bytes(model.config, 2, 40, 5, len(gen.eos_token_ids), torch.float32,
                                   kv_heads=model.kv_heads, long_chunk=gen.long_chunk, logprobs=k)
    got = sum(t.nbytes for t in gen.cache.buffers()) + sum(t.nbytes for t in gen.bufs.tensors().values())
    assert want == got
    assert gen.bufs.top_ids.shape == (2, 41, k) and gen.bufs.logprob.shape == (2, 41)
    off = Generator(model, max_len=40, chunk_size=5, batch=2)
    assert off.bufs.logprob.numel() == 0 and off.bufs.top_logprobs.numel() == 0  # off: nothing kept


def test_compiled_record_writes_in_place():
    """inductor reinplaces the index_put_ of the top-k record: no clone of the [B, N + 1, K] buffers."""
    from torch._inductor.utils import run_and_get_code

    B, N, V, T = 2, 1000, 64, 1
    bufs = steps.StepBuffers.allocate(B, 4, N, 8, 1, dtype=torch.float32, device=torch.device("cpu"), vocab=V,
                                      logprobs=K)
    tokens = torch.tensor([[3], [5]])  # [B, T]
    logits = torch.randn(B, T, V)  # [B, T, V]
    torch._dynamo.reset()
    try:
        _, codes = run_and_get_code(torch.compile(steps.emit, fullgraph=True), bufs, tokens,
                                    torch.ones(B, dtype=torch.int64), logits)
    finally:
        torch._dynamo.reset()
    ref = logits.log_softmax(-1)  # [B, T, V]
    assert torch.equal(bufs.top_ids[:, 0], ref[:, 0].topk(K).indices.to(torch.int32))
    assert torch.allclose(bufs.logprob[:, 0], ref[:, 0].gather(1, tokens).squeeze(1))
    lines = "\n".join(codes).splitlines()
    whole = (str((N + 1) * K), str(B * (N + 1) * K))  # a loop over a whole top buffer, or its copy
    assert not [ln for ln in lines if any(w in ln for w in whole) and ("for(" in ln or "empty_strided" in ln)]
    assert not [ln for ln in lines if "empty_strided" in ln and f"{N + 1}" in ln], "a top buffer is copied"
