"""PrefixCache: requests on one generator that reuse the longest cached prefix of their prompt.

Reference: a fresh `Generator.generate` of the whole prompt on a second generator (greedy). Pins: the reused
count is the longest common prefix with what the cache holds (the previous prompt and its reply but the last
token), never the whole prompt; output equals the fresh generate whether the prompt extends, shortens or leaves
the cached sequence; a stream closed part-way keeps its prompt cached; a refused request changes nothing; a
plain `generate` in between (it resets the cache) is noticed; the repetition penalty sees exactly the prompt.
"""

from __future__ import annotations

import pytest

from static_decode import Generator, load_model
from static_decode.checkpoints.loading import default_model_path
from static_decode.generation.prefix_cache import PrefixCache, common_prefix

MAX_LEN = 160


@pytest.fixture(scope="module")
def model():
    return load_model(default_model_path())


@pytest.fixture(scope="module")
def fresh(model):
    gen = Generator(model, max_len=MAX_LEN)
    return lambda prompt, n: gen.generate(prompt, n)


def run(pc: PrefixCache, prompt: list[int], n: int) -> tuple[int, list[int]]:
    reuse, pieces = pc.stream(prompt, n)
    return reuse.cached, [t for piece in pieces for t in piece]


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5], [6]) == 0


def test_reuse_is_the_longest_common_prefix_and_output_is_unchanged(model, fresh):
    pc = PrefixCache(Generator(model, max_len=MAX_LEN, read_every=3))
    a = list(b"def area(r):\n    return")
    cached, out = run(pc, a, 12)
    assert cached == 0 and out == fresh(a, 12)
    held = a + out[:-1]
    assert pc.cached() == held
    prompts = [
        held + list(b"\n\nclass X:"),  # extends everything cached (a chat's next turn)
        held[:10] + list(b"xyz = 1\n"),  # leaves it part-way
        held[:15],  # a prefix of it: all but the last token reused
        list(b"import os\n"),  # nothing in common
        list(b"import os\n"),  # the same prompt again
    ]
    for prompt in prompts:
        before = pc.cached()
        want = min(common_prefix(before, prompt), len(prompt) - 1)
        cached, out = run(pc, prompt, 12)
        assert cached == want, prompt
        assert out == fresh(prompt, 12), prompt
        assert pc.cached() == prompt + out[:-1]


def test_closed_stream_keeps_its_prompt_and_refusal_changes_nothing(model, fresh):
    gen = Generator(model, max_len=MAX_LEN, read_every=2)
    pc = PrefixCache(gen)
    p = list(b"for i in range(10):\n    ")
    _, pieces = pc.stream(p, 40)
    next(pieces), next(pieces)
    pieces.close()  # the client went away
    assert pc.cached() == p and gen.cache.host_lens[0] == len(p)
    q = p + list(b"print(i)")
    cached, out = run(pc, q, 10)
    assert cached == len(p) and out == fresh(q, 10)
    held = pc.cached()
    with pytest.raises(ValueError, match="max_len"):
        pc.stream(q + [1] * MAX_LEN, 4)
    with pytest.raises(ValueError):
        pc.stream(q, 0)
    assert pc.cached() == held  # refused before anything changed
    cached, out = run(pc, q, 10)
    assert cached == len(q) - 1 and out == fresh(q, 10)


def test_another_request_on_the_generator_is_noticed(model, fresh):
    gen = Generator(model, max_len=MAX_LEN)
    pc = PrefixCache(gen)
    p = list(b"while True:\n")
    run(pc, p, 6)
    gen.generate(list(b"x = "), 5)  # resets the cache under the prefix cache
    assert pc.cached() == []
    cached, out = run(pc, p, 6)
    assert cached == 0 and out == fresh(p, 6)


def test_repeat_penalty_marks_exactly_the_prompt(model):
    """The penalty's seen-token marks after a reused prefix are the whole prompt's, not the previous reply's."""
    gen, ref = Generator(model, max_len=MAX_LEN), Generator(model, max_len=MAX_LEN)
    pc = PrefixCache(gen)
    a = list(b"def parse(text):\n    ")
    _, first = run(pc, a, 30)
    for prompt in (a + first[:-1] + list(b"\n# done\n"), a[:8] + list(b"x):\n")):
        reuse, pieces = pc.stream(prompt, 20, repeat_penalty=1.5)
        assert reuse.cached > 0
        assert [t for p in pieces for t in p] == ref.generate(prompt, 20, repeat_penalty=1.5)


def test_a_stream_checks_the_cache_when_it_runs(model, fresh):
    """stream() plans the reuse; a request on the generator before the first next() resets the cache, so the
    iterator refuses then, before it cuts anything, rather than reuse another request's K/V."""
    gen = Generator(model, max_len=MAX_LEN)
    pc = PrefixCache(gen)
    prompt = list(b"def add(a, b):\n    return a + b\n")
    run(pc, prompt, 8)
    reuse, pieces = pc.stream(prompt + list(b"def sub"), 8)
    assert reuse.cached == len(prompt)
    gen.generate(list(b"import os"), 4)  # resets the cache under the planned request
    with pytest.raises(RuntimeError, match=f"planned to reuse {len(prompt)} cached tokens, 0 are there now"):
        next(pieces)
    assert run(pc, prompt + list(b"def sub"), 8) == (0, fresh(prompt + list(b"def sub"), 8))
