"""min_p, the presence and frequency penalties and the logit bias, on the device inside the steps.

Pins: `sampling.bias` and `sampling.penalize_counts` equal their formulas in numpy (OpenAI's logit_bias added at
its ids; logit[t] - presence * (count[t] > 0) - frequency * count[t]), exactly, eager and compiled (inductor);
`sampling.probabilities` with min_p equals a numpy reference of vLLM's order (temperature, min-p, top-k, top-p
over the renormalised rest) on random logits, eager and compiled, and draws follow it (chi-square); with
min_p 0.5 every sampled token has at least half the top token's probability, and min_p off changes no draw; a
logit bias of -100 on the likeliest token keeps it out of 1,000 seeded samples (and the token is likely without
it), +100 makes greedy pick it; the Generator's greedy and sampled tokens equal a plain loop over transformers'
full-sequence logits applying the references (bias, repetition penalty, counts of the emitted tokens, min_p);
the device counts equal a host recount of what each row emitted (ragged rows ending at EOS, a conversation's
later turn and a prefix-cache request counting only their own reply); compiled steps give the eager tokens for
the same seed; bad values are refused by name before anything is allocated, these samplers with speculation
likewise; the compiled token record adds to `counts` in place (no copy of the [B, V + 1] buffer in its generated
code).
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

PROMPT = [5, 17, 33, 2, 90, 61, 7, 5, 17]


# ---- numpy references ----------------------------------------------------------------------------------------
def ref_bias(logits: np.ndarray, bias: dict[int, float]) -> np.ndarray:
    out = logits.astype(np.float32).copy()
    for t, b in bias.items():
        out[t] += np.float32(b)
    return out


def ref_counts(logits: np.ndarray, counts: np.ndarray, presence: float, frequency: float) -> np.ndarray:
    """OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence."""
    c = counts.astype(np.float32)
    return logits.astype(np.float32) - np.float32(presence) * (c > 0) - np.float32(frequency) * c


def ref_repeat(logits: np.ndarray, seen: set[int], p: float) -> np.ndarray:
    out = logits.copy()
    for t in seen:
        out[t] = out[t] / p if out[t] > 0 else out[t] * p
    return out


def ref_kept(logits: np.ndarray, temperature: float, min_p: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """vLLM's order on one row (float64): probabilities at the temperature, min-p against the top one's, top-k,
    then top-p over the renormalised rest (the smallest prefix reaching it). The kept tokens as a bool mask."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    order = np.argsort(-z, kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    before = np.cumsum(q[order]) - q[order]
    if top_p < 1:
        keep[order[before >= top_p]] = False
    return keep


def ref_probs(logits: np.ndarray, temperature: float, min_p: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    keep = ref_kept(logits, temperature, min_p, top_k, top_p)
    z = logits.astype(np.float64) / temperature
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    return p / p.sum()


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# ---- the functions on random logits --------------------------------------------------------------------------
def random_case(B: int = 6, V: int = 200, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 3  # [B, V]
    ids = torch.stack([torch.randperm(V, generator=g)[:steps.LOGIT_BIAS_SLOTS] for _ in range(B)])  # [B, M]
    values = (torch.rand(B, steps.LOGIT_BIAS_SLOTS, generator=g) * 200 - 100)  # [B, M]
    values[:, 40:] = 0  # unused entries ...
    ids[:, 40:] = 0  # ... at id 0
    counts = torch.randint(0, 4, (B, V), generator=g, dtype=torch.int32) * (torch.rand(B, V, generator=g) < 0.3)
    presence = torch.tensor([0.0, 1.5, -2.0, 0.7, 0.0, 2.0])[:B]
    frequency = torch.tensor([0.0, 0.5, 1.0, -0.3, 2.0, -2.0])[:B]
    return logits, ids, values, counts.to(torch.int32), presence, frequency


def adjusted(logits, ids, values, counts, presence, frequency):
    return sampling.penalize_counts(sampling.bias(logits, ids, values), counts, presence, frequency)


@pytest.mark.parametrize("compiled", [False, True])
def test_bias_and_count_penalties_equal_their_formulas(compiled):
    logits, ids, values, counts, presence, frequency = random_case()
    fn = torch.compile(adjusted, fullgraph=True, dynamic=False) if compiled else adjusted
    got = fn(logits, ids, values, counts, presence, frequency).numpy()
    for b in range(logits.shape[0]):
        used = {int(t): float(v) for t, v in zip(ids[b, :40], values[b, :40], strict=True)}
        biased = ref_bias(logits[b].numpy(), used)
        want = ref_counts(biased, counts[b].numpy(), float(presence[b]), float(frequency[b]))
        np.testing.assert_allclose(got[b], want, rtol=0, atol=2e-5)  # float32 sums in another order at most
    # Off is exactly the identity: no entry, no penalty.
    zeros = torch.zeros_like(values)
    same = fn(logits, torch.zeros_like(ids), zeros, counts, torch.zeros(6), torch.zeros(6))
    assert torch.equal(same, logits)


@pytest.mark.parametrize("compiled", [False, True])
def test_min_p_probabilities_equal_the_reference(compiled):
    g = torch.Generator().manual_seed(1)
    B, V = 8, 300
    logits = torch.randn(B, V, generator=g) * 2  # [B, V]
    temperature = torch.tensor([1.0, 0.7, 1.5, 1.0, 0.5, 2.0, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.05, 0.1, 0.3, 0.02, 0.5, 1.0, 0.05])
    top_k = torch.tensor([0, 0, 20, 0, 5, 0, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.6, 0.9, 1.0, 1.0, 0.5])
    fn = sampling.probabilities
    if compiled:
        fn = torch.compile(fn, fullgraph=True, dynamic=False)
    got = fn(logits, temperature, top_k, top_p, min_p).double().numpy()
    for b in range(B):
        want = ref_probs(logits[b].numpy(), float(temperature[b]), float(min_p[b]), int(top_k[b]), float(top_p[b]))
        assert np.array_equal(got[b] > 0, want > 0), b  # the same kept set
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-7)
    assert (got[6] > 0).sum() == 1  # min_p 1 keeps the top token alone
    # The order is vLLM's: top-p over what min-p kept. Row 7 keeps fewer tokens than top-p over the full softmax
    # would, so the test sees the other order.
    full = ref_kept(logits[7].numpy(), 1.0, 0.0, 0, 0.5) & ref_kept(logits[7].numpy(), 1.0, 0.05)
    assert (got[7] > 0).sum() != full.sum()


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])  # [V]
N = 20_000


def draws(n: int = N, temperature: float = 1.0, min_p: float = 0.0, logits: torch.Tensor = LOGITS,
          bias: dict[int, float] | None = None, seed: int = 777, compiled: bool = False) -> np.ndarray:
    """n samples of `logits` (biased by `bias`), one per row, each with its own seed: the sampled ids."""
    V = logits.shape[-1]
    ids = torch.zeros(n, steps.LOGIT_BIAS_SLOTS, dtype=torch.int64)
    values = torch.zeros(n, steps.LOGIT_BIAS_SLOTS)
    for j, (t, b) in enumerate((bias or {}).items()):
        ids[:, j], values[:, j] = t, b

    def choose(logits, ids, values, temperature, top_k, top_p, seeds, step, min_p):
        return sampling.sample(sampling.bias(logits, ids, values), temperature, top_k, top_p, seeds, step, min_p)

    fn = torch.compile(choose, fullgraph=True, dynamic=False) if compiled else choose
    seeds = torch.tensor([sampling.row_seed(seed, b) for b in range(n)])
    return fn(logits.expand(n, V), ids, values, torch.full((n,), temperature), torch.zeros(n, dtype=torch.int64),
              torch.ones(n), seeds, torch.tensor(0), torch.full((n,), min_p)).numpy()


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    if counts[~support].any():
        return float("inf")
    expected = counts.sum() * probs[support]
    return float(((counts[support] - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(("temperature", "min_p"), [(1.0, 0.1), (0.7, 0.2), (2.0, 0.5)])
def test_min_p_draws_follow_the_reference(temperature, min_p):
    counts = np.bincount(draws(temperature=temperature, min_p=min_p), minlength=6)
    want = ref_probs(LOGITS.numpy(), temperature, min_p)
    assert chi2(counts, want) < 30.0  # <= 5 degrees of freedom: exceeded with probability < 2e-5
    assert chi2(counts, softmax(LOGITS.double().numpy() / temperature)) > 300  # min_p changed the distribution


def test_min_p_half_keeps_every_draw_above_half_the_top_probability():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(50, generator=g) * 1.5  # [V]
    for temperature in (0.8, 1.0, 3.0):
        p = softmax(logits.double().numpy() / temperature)
        got = draws(n=2000, temperature=temperature, min_p=0.5, logits=logits)
        assert (p[got] >= 0.5 * p.max()).all()
        assert len(set(got.tolist())) > 1  # more than the top token is drawn: the bound is not met by greedy
        off = draws(n=2000, temperature=temperature, min_p=0.0, logits=logits)
        assert (p[off] < 0.5 * p.max()).any()  # without min_p some draws fall below: the check can fail


def test_min_p_off_changes_no_draw():
    n = 2000
    plain = sampling.sample(LOGITS.expand(n, 6), torch.ones(n), torch.zeros(n, dtype=torch.int64), torch.ones(n),
                            torch.tensor([sampling.row_seed(3, b) for b in range(n)]), torch.tensor(0))  # no min_p
    assert np.array_equal(plain.numpy(), draws(n=n, seed=3, min_p=0.0))
    assert not np.array_equal(plain.numpy(), draws(n=n, seed=3, min_p=0.2))


@pytest.mark.parametrize("compiled", [False, True])
def test_a_bias_of_minus_100_bans_the_likeliest_token(compiled):
    got = draws(n=1000, bias={0: -100.0}, compiled=compiled)
    assert 0 not in got
    assert (draws(n=1000, compiled=compiled) == 0).sum() > 400  # without the bias it is drawn over half the time
    counts = np.bincount(got, minlength=6)
    assert chi2(counts, softmax(np.array([-98.0, 1.0, 0.5, 0.0, -1.0, -3.0]))) < 30.0  # the rest: renormalised
    assert (draws(n=1000, bias={5: 100.0}, compiled=compiled) == 5).all()  # +100 all but forces one


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
