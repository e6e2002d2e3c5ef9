"""min_p, the presence and frequency penalties and the logit bias through the Generator.

Pins: the Generator's greedy and sampled tokens equal a plain loop over transformers' full-sequence logits applying
the references (bias, repetition penalty, counts of the emitted tokens, min_p); the device counts equal a host
recount of what each row emitted (ragged rows ending at EOS, a conversation's later turn and a prefix-cache request
counting only their own reply); compiled steps give the eager tokens for the same seed; bad values are refused by
name before anything is allocated, these samplers with speculation likewise; the compiled token record adds to
`counts` in place (no copy of the [B, V + 1] buffer in its generated code).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from capture import CaptureOptions, CompileSettings
from static_decode import Generator, load_model
from static_decode.generation.conversation import Conversation
from static_decode.generation.prefix_cache import PrefixCache
from static_decode.generation.request import SamplingParams
from static_decode.steps import functions as steps
from static_decode.steps import sampling
from static_decode.steps.speculation import PromptLookup
from tests.support.checkpoints import VOCAB, hf_llama, hf_logits, save
from tests.support.sampler_refs import ref_bias, ref_counts, ref_kept, ref_repeat

PROMPT = [5, 17, 33, 2, 90, 61, 7, 5, 17]


# ---- through the Generator -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_llama(seed=37)
    return hf, load_model(save(hf, tmp_path_factory.mktemp("samplers")))


def reference_tokens(hf, prompt: list[int], n: int, *, temperature: float = 0.0, seed: int = 0, min_p: float = 0.0,
                     presence: float = 0.0, frequency: float = 0.0, bias: dict[int, float] | None = None,
                     repeat: float = 1.0, top_p: float = 1.0) -> list[int]:
    """Tokens from transformers' logits of the whole sequence at every step, adjusted by the references (bias,
    repetition penalty over prompt and output, counts of the output), the sampled ones filtered by ref_kept
    (the filtered tokens at -inf) and drawn with static_decode's noise for (seed, step) and no filter of its own."""
    ids, out = list(prompt), []
    for i in range(n):
        raw = hf_logits(hf, ids)[-1].numpy()
        x = ref_bias(raw, bias or {})
        x = ref_repeat(x, set(ids), repeat)
        x = ref_counts(x, np.bincount(out, minlength=len(raw)), presence, frequency)
        if temperature == 0:
            t = int(np.argmax(x))
        else:
            x = np.where(ref_kept(x, temperature, min_p, 0, top_p), x, -np.inf).astype(np.float32)
            t = int(sampling.sample(
                torch.from_numpy(x)[None], torch.tensor([temperature]), torch.tensor([0]), torch.tensor([1.0]),
                torch.tensor([sampling.row_seed(seed, 0)]), torch.tensor(i),
            )[0])
        ids.append(t)
        out.append(t)
    return out


CASES = {
    "presence": dict(presence=2.0),
    "frequency": dict(frequency=2.0),
    "negative": dict(presence=-1.0, frequency=-0.5),
    "bias": dict(bias={40: 3.0, 16: -100.0, 7: 2.5}),
    "all": dict(presence=0.5, frequency=0.8, bias={3: 4.0, 77: -2.0}, repeat=1.3),
}


def options(case: dict) -> dict:
    names = {"presence": "presence_penalty", "frequency": "frequency_penalty", "bias": "logit_bias",
             "repeat": "repeat_penalty", "min_p": "min_p", "top_p": "top_p"}
    return {names[k]: v for k, v in case.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_the_reference(pair, case):
    hf, model = pair
    gen = Generator(model, max_len=40, chunk_size=4, eos_token_ids=[])
    want = reference_tokens(hf, PROMPT, 12, **CASES[case])
    assert gen.generate(PROMPT, 12, **options(CASES[case])) == want
    assert want != reference_tokens(hf, PROMPT, 12)  # the sampler changed something: the test can fail


@pytest.mark.parametrize("case", [dict(min_p=0.2), dict(min_p=0.05, top_p=0.8), dict(presence=1.0, min_p=0.1),
                                  dict(frequency=2.0, bias={50: 2.0})])
def test_sampled_tokens_equal_the_reference(pair, case):
    hf, model = pair
    gen = Generator(model, max_len=40, chunk_size=4, eos_token_ids=[])
    got = gen.generate(PROMPT, 10, temperature=1.2, seed=5, **options(case))
    assert got == reference_tokens(hf, PROMPT, 10, temperature=1.2, seed=5, **case)


def test_counts_equal_a_host_recount(pair):
    hf, model = pair
    rows = [PROMPT, [40, 41, 40, 41], [9, 8, 7]]
    gen = Generator(model, max_len=40, chunk_size=4, eos_token_ids=[])
    free = gen.generate(rows, 14, temperature=1.5, seed=2)
    eos = free[1][5]  # an id row 1 emits part-way: with it as EOS the rows stop at different steps
    gen = Generator(model, max_len=40, chunk_size=4, eos_token_ids=[eos])
    got = gen.generate(rows, 14, temperature=1.5, seed=2, presence_penalty=0.0, frequency_penalty=0.1)
    assert len({len(r) for r in got}) > 1  # ragged: some row stopped early
    counts = gen.bufs.counts[:, :-1].numpy()  # [B, V]
    for b, toks in enumerate(got):
        assert counts[b].tolist() == np.bincount(toks, minlength=VOCAB).tolist()
    # The next request starts from zero.
    again = gen.generate([3, 4], 5, frequency_penalty=1.0)
    assert gen.bufs.counts[0, :-1].tolist() == np.bincount(again, minlength=VOCAB).tolist()
    assert gen.bufs.counts[1:, :-1].sum() == 0


def test_a_conversation_turn_counts_its_own_reply(pair):
    _, model = pair
    gen = Generator(model, max_len=64, chunk_size=4, eos_token_ids=[])
    conv = Conversation(gen)
    turn1, turn2 = PROMPT, [9, 9, 3]
    reply1 = list(conv.send(turn1, 6, frequency_penalty=1.0, presence_penalty=0.5))
    reply2 = list(conv.send(turn2, 6, frequency_penalty=1.0, presence_penalty=0.5))
    assert gen.bufs.counts[0, :-1].tolist() == np.bincount(reply2, minlength=VOCAB).tolist()
    single = Generator(model, max_len=64, chunk_size=4, eos_token_ids=[])  # the earlier reply is prompt now
    assert single.generate(turn1 + reply1 + turn2, 6, frequency_penalty=1.0, presence_penalty=0.5) == reply2


def test_a_prefix_cache_request_equals_a_fresh_one(pair):
    """A request reusing a cached prefix counts only its own reply, as a fresh request over the whole prompt."""
    _, model = pair
    every = dict(presence_penalty=0.7, frequency_penalty=1.2, logit_bias={40: -100, 3: 1.5}, min_p=0.05,
                 temperature=0.9, seed=8)
    gen = Generator(model, max_len=64, chunk_size=4, eos_token_ids=[])
    prefix = PrefixCache(gen)
    first = [t for piece in prefix.stream(PROMPT, 8, **every)[1] for t in piece]
    again = PROMPT + first + [9, 9]
    reuse, pieces = prefix.stream(again, 8, **every)
    got = [t for piece in pieces for t in piece]
    assert reuse.cached > 0
    fresh = Generator(model, max_len=64, chunk_size=4, eos_token_ids=[])
    assert got == fresh.generate(again, 8, **every)
    assert gen.bufs.counts[0, :-1].tolist() == np.bincount(got, minlength=VOCAB).tolist()


def test_compiled_tokens_equal_eager_tokens(pair):
    """compile=True through the capture layer (dynamo + AOT autograd), every sampler set, greedy and sampled."""
    _, model = pair
    every = dict(min_p=0.1, presence_penalty=0.6, frequency_penalty=0.4, logit_bias={40: -100, 3: 2.0})
    eager = Generator(model, max_len=40, chunk_size=4, eos_token_ids=[])
    want_greedy = eager.generate(PROMPT, 10, **every)
    want_sampled = eager.generate(PROMPT, 10, temperature=1.1, seed=3, **every)
    torch._dynamo.reset()
    opts = CaptureOptions(settings=CompileSettings(backend="aot_eager"), warm_up="lazy", progress=False)
    gen = Generator(model, max_len=40, chunk_size=4, compile=True, eos_token_ids=[], capture=opts)
    assert gen.generate(PROMPT, 10, **every) == want_greedy
    assert gen.generate(PROMPT, 10, temperature=1.1, seed=3, **every) == want_sampled
    assert gen.generate(PROMPT, 10) == eager.generate(PROMPT, 10)  # the same graphs with everything off
    assert 40 not in want_sampled and want_sampled != eager.generate(PROMPT, 10, temperature=1.1, seed=3)


# ---- refusals ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "bad"), [
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.nan), ("min_p", True), ("min_p", "0.1"),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", math.inf),
    ("frequency_penalty", math.nan), ("frequency_penalty", 3), ("frequency_penalty", False),
])
def test_bad_values_are_refused_by_name(pair, name, bad):
    _, model = pair
    gen = Generator(model, max_len=40, eos_token_ids=[])
    with pytest.raises(ValueError, match=name):
        gen.generate(PROMPT, 4, **{name: bad})
    assert gen.cache is None  # refused before anything was allocated


@pytest.mark.parametrize(("bias", "error", "match"), [
    ({VOCAB: 1.0}, ValueError, f"token id {VOCAB}; token ids must be in 0..{VOCAB - 1}"),
    ({-1: 1.0}, ValueError, "logit_bias token id must be an int >= 0, got -1"),
    ({"5": 1.0}, TypeError, "logit_bias token id must be an int"),
    ({5: 100.5}, ValueError, r"logit_bias\[5\] must be a number in \[-100, 100\], got 100.5"),
    ({5: math.nan}, ValueError, r"logit_bias\[5\]"),
    ({True: 1.0}, TypeError, "token id must be an int"),
    ([(5, 1.0), (5, 2.0)], ValueError, "token id 5 twice"),
    ({t: 1.0 for t in range(65)}, ValueError, "65 entries; at most 64"),
    (3.0, TypeError, "logit_bias must be a mapping"),
])
def test_bad_logit_bias_is_refused_by_name(pair, bias, error, match):
    _, model = pair
    gen = Generator(model, max_len=40, eos_token_ids=[])
    with pytest.raises(error, match=match):
        gen.generate(PROMPT, 4, logit_bias=bias)
    assert gen.cache is None


def test_params_keep_the_bias_as_sorted_pairs():
    p = SamplingParams(logit_bias={9: np.float32(-1.5), np.int64(2): 100})
    assert p.logit_bias == ((2, 100.0), (9, -1.5)) and hash(p) == hash(SamplingParams(logit_bias=[(9, -1.5), (2, 100)]))
    assert SamplingParams(min_p=np.float64(0.25), presence_penalty=np.int64(1)).presence_penalty == 1.0


@pytest.mark.parametrize("option", [dict(min_p=0.1), dict(presence_penalty=0.5), dict(frequency_penalty=-1.0),
                                    dict(logit_bias={3: 1.0})])
def test_the_samplers_with_speculation_are_refused(pair, option):
    _, model = pair
    gen = Generator(model, max_len=40, eos_token_ids=[], speculate=PromptLookup(tokens=2, ngram=2))
    (name, _), = option.items()
    with pytest.raises(ValueError, match=f"{name}=.* is not supported with speculative decoding"):
        gen.generate(PROMPT, 4, **option)
    plain = Generator(model, max_len=40, eos_token_ids=[]).generate(PROMPT, 4)
    off = dict(min_p=0.0, presence_penalty=0, frequency_penalty=0.0, logit_bias={})
    assert gen.generate(PROMPT, 4, **off) == plain  # off values are allowed


def test_compiled_token_record_counts_in_place():
    """`steps.emit` compiled: the [B, V + 1] counts are added to where the tokens go, never copied whole."""
    from torch._inductor.utils import run_and_get_code

    V = 100_000
    bufs = steps.StepBuffers.allocate(1, 4, 32, 8, 1, dtype=torch.float32, device=torch.device("cpu"), vocab=V)
    bufs.counts[0, 3] = 2
    tokens, count = torch.tensor([[7, 9, 7]]), torch.tensor([3])
    _, codes = run_and_get_code(torch.compile(steps.emit, fullgraph=True), bufs, tokens, count)
    lines = "\n".join(codes).splitlines()
    width = str(V + 1)
    assert not [ln for ln in lines if width in ln and ("for(" in ln or "empty_strided" in ln)], "counts is copied"
    nz = bufs.counts[0].nonzero().flatten().tolist()
    assert nz == [3, 7, 9] and bufs.counts[0, nz].tolist() == [2, 2, 1]
