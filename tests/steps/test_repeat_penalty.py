"""The repetition penalty: CTRL's (and llama.cpp's) definition, applied on the device inside the steps.

Pins: `sampling.penalize` equals an element-by-element reference (a seen token's logit divided by the penalty
when positive, multiplied when negative; unseen ones untouched); penalty 1 changes nothing; the Generator's
greedy and sampled tokens equal a plain loop over transformers' full-sequence logits that applies that
reference to the prompt and every token emitted so far; compiled steps give the eager tokens; a conversation's
later turn penalises the earlier turns' tokens as a single-shot request over the whole history does; bad
penalties and a penalty with speculation are refused by name before anything runs; the compiled token record
marks `seen` in place (no copy of the [B, V + 1] mask in its generated code).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from capture import CaptureOptions, CompileSettings
from static_decode import Generator, load_model
from static_decode.generation.conversation import Conversation
from static_decode.steps import sampling
from static_decode.steps.speculation import PromptLookup
from tests.support.checkpoints import hf_llama, hf_logits, save

PROMPT = [5, 17, 33, 2, 90, 61, 7, 5, 17]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_llama(seed=37)
    return hf, load_model(save(hf, tmp_path_factory.mktemp("penalty")))


def reference_penalty(logits: list[float], seen: set[int], p: float) -> list[float]:
    """CTRL / llama.cpp: for each token already seen, logit / p if the logit is positive, else logit * p."""
    return [(x / p if x > 0 else x * p) if v in seen else x for v, x in enumerate(logits)]


def reference_tokens(hf, prompt: list[int], n: int, p: float, temperature: float = 0.0, seed: int = 0) -> list[int]:
    """Greedy (or sampled with static_decode's sampler) tokens from transformers' logits of the whole sequence
    at every step, penalised by the reference over the prompt and the tokens emitted so far."""
    ids, out = list(prompt), []
    for i in range(n):
        raw = hf_logits(hf, ids)[-1].tolist()
        logits = torch.tensor([reference_penalty(raw, set(ids), p)], dtype=torch.float32)  # [1, V]
        if temperature == 0:
            t = int(logits.argmax())
        else:
            t = int(sampling.sample(
                logits, torch.tensor([temperature]), torch.tensor([0]), torch.tensor([1.0]),
                torch.tensor([sampling.row_seed(seed, 0)]), torch.tensor(i),
            )[0])
        ids.append(t)
        out.append(t)
    return out


def test_penalize_equals_the_elementwise_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 4  # [B, V] both signs
    logits[0, :3] = torch.tensor([0.0, -0.0, 1e-30])
    seen = torch.rand(3, 50, generator=g) < 0.4  # [B, V]
    penalty = torch.tensor([1.3, 0.7, 1.0])  # [B]: above 1, below 1 (encourages repeats), off
    got = sampling.penalize(logits, seen, penalty)
    for b in range(3):
        want = reference_penalty(logits[b].tolist(), set(torch.nonzero(seen[b]).flatten().tolist()),
                                 float(penalty[b]))
        assert got[b].tolist() == torch.tensor(want, dtype=torch.float32).tolist()
    assert torch.equal(got[2], logits[2])  # penalty 1 is exactly the identity
    assert got.dtype == torch.float32
    assert torch.equal(sampling.penalize(logits.bfloat16(), seen, penalty)[2], logits[2].bfloat16().float())


@pytest.mark.parametrize("p", [1.5, 0.6])
def test_greedy_tokens_equal_the_reference(pair, p):
    hf, model = pair
    gen = Generator(model, max_len=40, chunk_size=4, eos_token_ids=[])
    want = reference_tokens(hf, PROMPT, 12, p)
    assert gen.generate(PROMPT, 12, repeat_penalty=p) == want
    assert want != reference_tokens(hf, PROMPT, 12, 1.0)  # the penalty changed something: the test can fail


def test_sampled_tokens_equal_the_reference(pair):
    hf, model = pair
    gen = Generator(model, max_len=40, chunk_size=4, eos_token_ids=[])
    got = gen.generate(PROMPT, 10, temperature=0.8, seed=5, repeat_penalty=1.4)
    assert got == reference_tokens(hf, PROMPT, 10, 1.4, temperature=0.8, seed=5)


def test_penalty_off_is_the_plain_output(pair):
    _, model = pair
    gen = Generator(model, max_len=40, eos_token_ids=[])
    plain = gen.generate(PROMPT, 10)
    assert gen.generate(PROMPT, 10, repeat_penalty=1.0) == plain
    gen.generate(PROMPT, 10, repeat_penalty=2.0)  # a penalised request leaves nothing behind for the next
    assert gen.generate(PROMPT, 10) == plain


def test_batch_rows_keep_their_own_seen_tokens(pair):
    _, model = pair
    rows = [PROMPT, [40, 41, 40, 41]]
    gen = Generator(model, max_len=40, chunk_size=4, eos_token_ids=[])
    assert gen.generate(rows, 8, repeat_penalty=1.5) == [gen.generate(r, 8, repeat_penalty=1.5) for r in rows]


def test_compiled_tokens_equal_eager_tokens(pair):
    """compile=True through the capture layer (dynamo + AOT autograd: the same graph, no code generation)."""
    _, model = pair
    eager = Generator(model, max_len=40, chunk_size=4, eos_token_ids=[])
    want_greedy = eager.generate(PROMPT, 10, repeat_penalty=1.5)
    want_sampled = eager.generate(PROMPT, 10, temperature=0.9, seed=3, repeat_penalty=1.5)
    torch._dynamo.reset()
    opts = CaptureOptions(settings=CompileSettings(backend="aot_eager"), warm_up="lazy", progress=False)
    gen = Generator(model, max_len=40, chunk_size=4, compile=True, eos_token_ids=[], capture=opts)
    assert gen.generate(PROMPT, 10, repeat_penalty=1.5) == want_greedy
    assert gen.generate(PROMPT, 10, temperature=0.9, seed=3, repeat_penalty=1.5) == want_sampled
    assert gen.generate(PROMPT, 10) == eager.generate(PROMPT, 10)  # the same graphs with the penalty off


def test_a_later_turn_penalises_the_earlier_turns(pair):
    _, model = pair
    gen = Generator(model, max_len=64, chunk_size=4, eos_token_ids=[])
    conv = Conversation(gen)
    turn1, turn2 = PROMPT, [9, 9, 3]
    reply1 = list(conv.send(turn1, 6, repeat_penalty=1.5))
    reply2 = list(conv.send(turn2, 6, repeat_penalty=1.5))
    single = Generator(model, max_len=64, chunk_size=4, eos_token_ids=[])
    assert single.generate(turn1 + reply1 + turn2, 6, repeat_penalty=1.5) == reply2


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "1.1"])
def test_bad_penalties_are_refused_by_name(pair, bad):
    _, model = pair
    gen = Generator(model, max_len=40, eos_token_ids=[])
    with pytest.raises(ValueError, match="repeat_penalty"):
        gen.generate(PROMPT, 4, repeat_penalty=bad)
    assert gen.cache is None  # refused before anything was allocated


def test_a_penalty_with_speculation_is_refused(pair):
    _, model = pair
    gen = Generator(model, max_len=40, eos_token_ids=[], speculate=PromptLookup(tokens=2, ngram=2))
    with pytest.raises(ValueError, match="repeat_penalty=1.2 is not supported with speculative"):
        gen.generate(PROMPT, 4, repeat_penalty=1.2)
    plain = Generator(model, max_len=40, eos_token_ids=[]).generate(PROMPT, 4)
    assert gen.generate(PROMPT, 4, repeat_penalty=np.float32(1.0)) == plain  # 1 is off: allowed


def test_compiled_token_record_marks_seen_in_place():
    """`steps.emit` compiled: the [B, V + 1] seen mask is written where the tokens go, never copied. A scatter_
    there became a copy of the whole mask, the scatter and a copy back (on the CPU a byte at a time, ~1 ms a step
    at SmolLM2's vocabulary); the generated code then allocates a [1, V + 1] buffer and loops over V + 1."""
    from torch._inductor.utils import run_and_get_code

    from static_decode.steps import functions as steps

    V = 100_000
    bufs = steps.StepBuffers.allocate(1, 4, 32, 8, 1, dtype=torch.float32, device=torch.device("cpu"), vocab=V)
    bufs.seen[0, 3] = True
    tokens, count = torch.tensor([[7, 9]]), torch.tensor([2])
    _, codes = run_and_get_code(torch.compile(steps.emit, fullgraph=True), bufs, tokens, count)
    lines = "\n".join(codes).splitlines()
    width = str(V + 1)
    assert not [ln for ln in lines if width in ln and ("for(" in ln or "empty_strided" in ln)], "seen is copied"
    assert bufs.seen[0].nonzero().flatten().tolist() == [3, 7, 9]
    assert bufs.out[0, :2].tolist() == [7, 9] and int(bufs.step[0]) == 2
