"""Multi-turn conversations on one cache: each turn prefills only its own tokens, and every reply equals a fresh
single-shot generate over the whole conversation so far (greedy and seeded sampling, eager and compiled)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capture import CaptureOptions, CompileSettings
from static_decode import Conversation, Generator, load_model
from tests.support.checkpoints import hf_llama, save

TURNS = [[5, 17, 33, 2, 90, 61, 7], [40, 41, 42], [9] * 11]
MAX_LEN, CHUNK = 96, 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(save(hf_llama(seed=5), tmp_path_factory.mktemp("conv")))


class Spy(Generator):
    """Records every step launch as (kind, read_len)."""

    def step_fn(self, kind, read_len):
        self.launches.append((kind, read_len))
        return super().step_fn(kind, read_len)


def _spy(model, **kw) -> Spy:
    gen = Spy(model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[], **kw)
    gen.launches = []
    return gen


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.9, "seed": 7}])
def test_each_turn_prefills_only_its_own_tokens_and_equals_a_fresh_generate(model, sampling) -> None:
    gen, fresh = _spy(model), Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[])
    conv = Conversation(gen)
    for n, turn in enumerate(TURNS):
        before = list(conv.tokens)
        gen.launches.clear()
        reply = list(conv.send(turn, 6, **sampling))
        fed = len(turn) + (1 if n else 0)  # turn 2 on also feeds the last reply's last token
        assert gen.stats.prompt_tokens == fed
        prefills = [r for k, r in gen.launches if k == "prefill"]
        assert len(prefills) == -(-fed // CHUNK)  # chunks of this turn only, not of the history
        assert reply == fresh.generate(before + turn, 6, **sampling), f"turn {n + 1}"
        assert conv.tokens == before + turn + reply
        assert int(gen.cache.host_lens[0]) == len(conv.tokens) - 1 == int(gen.cache.lens[0])


def test_compiled_conversation_equals_eager(model) -> None:
    torch._dynamo.reset()
    opts = CaptureOptions(buckets=(32, MAX_LEN), settings=CompileSettings(backend="eager"), warm_up="lazy",
                          progress=False)
    compiled = Conversation(Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[], compile=True,
                                      capture=opts))
    eager = Conversation(Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[]))
    for turn in TURNS:
        assert list(compiled.send(turn, 8)) == list(eager.send(turn, 8))
    torch._dynamo.reset()


def test_a_turn_that_does_not_fit_is_refused_naming_it_and_nothing_changes(model) -> None:
    gen = Generator(model, max_len=24, chunk_size=CHUNK, eos_token_ids=[])
    conv = Conversation(gen)
    list(conv.send(TURNS[0], 6))  # 7 + 6 = 13 positions
    history, lens, k = list(conv.tokens), gen.cache.host_lens.copy(), gen.cache.k.clone()
    with pytest.raises(ValueError, match=r"turn 2 does not fit: 12 cached \+ 4 new \+ max_new_tokens=9 = 25 > "):
        conv.send(TURNS[1], 9)
    assert conv.tokens == history and np.array_equal(gen.cache.host_lens, lens) and torch.equal(gen.cache.k, k)
    assert len(list(conv.send(TURNS[1], 8))) == 8  # what fits still goes


def test_a_reset_cache_or_an_abandoned_turn_ends_the_conversation(model) -> None:
    gen = Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[])
    conv = Conversation(gen)
    list(conv.send(TURNS[0], 4))
    gen.generate([1, 2, 3], 4)  # a plain request resets the cache under the conversation
    with pytest.raises(RuntimeError, match="turn 2: another request reset this generator's cache"):
        conv.send(TURNS[1], 4)
    conv.reset()  # starts over from an empty cache
    assert len(list(conv.send(TURNS[0], 4))) == 4
    it = conv.send(TURNS[1], 8)
    next(it)
    it.close()  # abandoned mid-turn: the generator resets its cache, and the history with it
    with pytest.raises(RuntimeError, match="turn 2: another request reset"):
        conv.send(TURNS[2], 4)


def test_bad_turns_are_refused_before_anything_runs(model) -> None:
    gen = Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[])
    conv = Conversation(gen)
    for ids, n, err in (([], 4, ValueError), ([1, 10**9], 4, ValueError), ([1], 0, ValueError), ([1], 1.5, TypeError)):
        with pytest.raises(err):
            conv.send(ids, n)
    assert conv.turns == 0 and gen.cache is None
    with pytest.raises(TypeError, match="Generator"):
        Conversation("not a generator")


def test_a_turn_checks_the_cache_when_it_runs_not_only_when_sent(model) -> None:
    """send() returns an iterator; a request on the same generator before its first next() resets the cache, so
    the turn must refuse then (before anything runs), not append to the other request's tokens."""
    gen = Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[])
    conv = Conversation(gen)
    first = list(conv.send(TURNS[0], 6))
    turn = conv.send(TURNS[1], 6)  # checked now: the history is cached
    other = gen.generate([1, 2, 3], 4)  # resets the cache
    with pytest.raises(RuntimeError, match="another request reset this generator's cache since turn 1"):
        next(turn)
    assert conv.tokens == TURNS[0] + first and conv.turns == 1  # the conversation believes nothing new
    assert gen.generate([1, 2, 3], 4) == other  # and the generator is free
    with pytest.raises(RuntimeError, match="another request reset"):
        conv.send(TURNS[1], 6)


def test_two_turns_sent_before_either_runs_the_second_refuses(model) -> None:
    conv = Conversation(Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[]))
    a, b = conv.send(TURNS[0], 4), conv.send(TURNS[1], 4)
    reply = list(a)
    with pytest.raises(RuntimeError, match=r"turn 1: the conversation moved on \(turn 1 ran\)"):
        next(b)
    assert conv.tokens == TURNS[0] + reply and conv.turns == 1
    fresh = Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[])
    assert list(conv.send(TURNS[1], 4)) == fresh.generate(TURNS[0] + reply + TURNS[1], 4)
