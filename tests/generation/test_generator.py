"""The Generator: one cache reused across requests, ragged batches, EOS handling, streaming, refusals.

Pins: a refused request (too long, malformed) changes nothing and the generator keeps working; the cache is
allocated once (same storage across requests; regrown only for a batch larger than any before); rows that
emit EOS stop (EOS included) while the others go on, and keep their output; streaming reads the device
lazily (the first token before any decode step, then one read per `read_every` steps); every step launch
goes through `read_len` / `step_fn` with a read length covering the longest row; the host mirror of the lengths
ends equal to the device lengths; greedy output equals transformers' with compile on and off.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from capture import CaptureOptions, CompileSettings
from static_decode import Generator, Llama, LlamaConfig, load_model
from static_decode.checkpoints.loading import default_model_path
from static_decode.steps.functions import STEPS
from tests.support.checkpoints import VOCAB, hf_greedy, hf_llama, save
from tests.support.memory_maps import mapping_of

PROMPTS = [[5, 17, 33, 2, 90, 61, 7], [40, 41], [9] * 19]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_llama(seed=31)
    return hf, load_model(save(hf, tmp_path_factory.mktemp("gen")))


@pytest.fixture(scope="module")
def model(pair):
    return pair[1]


def ptrs(gen: Generator) -> tuple[int, int]:
    return gen.cache.k.data_ptr(), gen.cache.v.data_ptr()


def test_ragged_batch_equals_single_requests_and_transformers(pair):
    hf, model = pair
    gen = Generator(model, max_len=48, chunk_size=8, eos_token_ids=[])
    batch = gen.generate(PROMPTS, 12)
    assert batch == [hf_greedy(hf, p, 12, eos=None) for p in PROMPTS]
    assert [gen.generate(p, 12) for p in PROMPTS] == batch


def test_rows_stop_at_their_own_eos_and_keep_their_output(pair):
    hf, model = pair
    free = [hf_greedy(hf, p, 12, eos=None) for p in PROMPTS]
    eos = free[0][3]  # row 0 stops at its 4th token; other rows stop wherever they first emit it, if ever
    expected = [hf_greedy(hf, p, 12, eos=eos) for p in PROMPTS]
    assert len(expected[0]) == 4 and any(len(e) == 12 for e in expected)
    gen = Generator(model, max_len=48, chunk_size=8, eos_token_ids=[eos], read_every=2)
    assert gen.generate(PROMPTS, 12) == expected
    assert gen.generate(PROMPTS, 12, stop_at_eos=False) == free


def test_cache_is_allocated_once_and_reused(model):
    gen = Generator(model, max_len=48, eos_token_ids=[])
    assert gen.cache is None  # no batch given: allocated at the first request
    gen.generate(PROMPTS[0], 4)
    first = ptrs(gen)
    gen.generate(PROMPTS[1], 4)
    assert ptrs(gen) == first and gen.cache.batch == 1
    gen.generate(PROMPTS, 4)  # a larger batch: regrown once
    grown = ptrs(gen)
    assert gen.cache.batch == 3
    gen.generate(PROMPTS[:2], 4)
    gen.generate(PROMPTS[2], 4)
    assert ptrs(gen) == grown and gen.cache.batch == 3


def test_fixed_batch_allocates_up_front_and_refuses_more_rows(model):
    gen = Generator(model, max_len=48, batch=2, eos_token_ids=[])
    before = ptrs(gen)
    with pytest.raises(ValueError, match="batch=2"):
        gen.generate(PROMPTS, 4)
    gen.generate(PROMPTS[:2], 4)
    assert ptrs(gen) == before


def test_refused_requests_leave_the_generator_working(model):
    gen = Generator(model, max_len=24, chunk_size=8, eos_token_ids=[])
    expected = gen.generate(PROMPTS[0], 6)
    storage, lens = ptrs(gen), gen.cache.host_lens.copy()
    bad = [
        ((list(range(20)), 5), "25 > max_len=24"),  # prompt + new tokens past max_len
        (([[1, 2], list(range(23))], 2), "row 1"),
        (([], 4), "non-empty"),
        (([[1], []], 4), "row 1"),
        (([1, VOCAB], 4), str(VOCAB)),
        (([1, -1], 4), "-1"),
        (([1, 2], 0), "max_new_tokens"),
        (("hello", 4), "prompt"),
    ]
    for (prompt, n), word in bad:
        with pytest.raises(ValueError, match=word):
            gen.generate(prompt, n)
    for kwargs, word in [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"seed": -3}, "seed"),
    ]:
        with pytest.raises(ValueError, match=word):
            gen.generate(PROMPTS[0], 6, **kwargs)
    assert ptrs(gen) == storage and np.array_equal(gen.cache.host_lens, lens)
    assert gen.generate(PROMPTS[0], 6) == expected


def test_constructor_checks():
    with pytest.raises(TypeError, match="Llama"):
        Generator(object(), max_len=8)


def test_host_mirror_ends_equal_to_device_lengths(pair):
    hf, model = pair
    eos = hf_greedy(hf, PROMPTS[0], 10, eos=None)[2]
    gen = Generator(model, max_len=48, chunk_size=8, eos_token_ids=[eos], read_every=3)
    out = gen.generate(PROMPTS, 10)
    expected = [len(p) + len(o) - 1 for p, o in zip(PROMPTS, out, strict=True)]  # the last token is not fed
    assert gen.cache.host_lens.tolist() == expected == gen.cache.lens.tolist()


class Recording(Generator):
    """Records every launch (kind, read_len) and checks the read covers every row after the step."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.launches: list[tuple[str, int]] = []

    def step_fn(self, kind, read_len):
        fn = super().step_fn(kind, read_len)

        def run(model, cache, bufs, r):
            fn(model, cache, bufs, r)
            self.launches.append((kind, r))
            if kind.startswith(("prefill", "decode")):
                assert int(cache.lens.max()) <= r  # test-side read: the generator itself never reads lens

        return run


def test_every_launch_goes_through_the_hooks_with_a_covering_read(model):
    gen = Recording(model, max_len=48, chunk_size=8, eos_token_ids=[])
    gen.generate(PROMPTS, 5)
    kinds = [k for k, _ in gen.launches]
    assert kinds == ["prefill"] * 3 + ["first_greedy"] + ["decode_greedy"] * 4  # 19 tokens: 3 chunks of 8
    assert [r for _, r in gen.launches] == [8, 16, 19, 0, 20, 21, 22, 23]  # exact in eager mode
    gen.launches.clear()
    gen.generate(PROMPTS[1], 3, temperature=1.0, seed=0)
    assert [k for k, _ in gen.launches] == ["prefill", "first", "decode", "decode"]


def test_stream_reads_lazily(model):
    gen = Generator(model, max_len=48, eos_token_ids=[])
    expected = gen.generate(PROMPTS[0], 10)
    it = gen.stream(PROMPTS[0], 10, read_every=4)
    assert next(it) == expected[0]
    assert int(gen.bufs.step) == 1  # the first token came back before any decode step was launched
    assert next(it) == expected[1]
    assert int(gen.bufs.step) == 5  # tokens 1..4 were read back together, after 4 steps
    assert [expected[0], expected[1], *it] == expected


def test_a_request_while_a_stream_is_open_is_refused_and_the_stream_survives(model):
    gen = Generator(model, max_len=48, eos_token_ids=[])
    expected = gen.generate(PROMPTS[0], 10)
    other = gen.generate(PROMPTS[1], 5)
    it = gen.stream(PROMPTS[0], 10, read_every=2)
    got = [next(it), next(it)]
    lens, k = gen.cache.lens.clone(), gen.cache.k.clone()
    with pytest.raises(RuntimeError, match="still running a stream"):
        gen.generate(PROMPTS[1], 5)
    second = gen.stream(PROMPTS[1], 5)  # checked now; refused at its first next()
    with pytest.raises(RuntimeError, match="still running a stream"):
        next(second)
    assert torch.equal(gen.cache.lens, lens) and torch.equal(gen.cache.k, k)  # nothing touched
    assert [*got, *it] == expected  # the open stream carries on as if nothing happened
    assert gen.generate(PROMPTS[1], 5) == other  # finished: the generator takes requests again
    it = gen.stream(PROMPTS[0], 10)
    next(it)
    it.close()  # closed early: also free
    assert gen.generate(PROMPTS[1], 5) == other


def test_stream_of_a_batch_yields_pieces_per_row(model):
    gen = Generator(model, max_len=48, eos_token_ids=[])
    expected = gen.generate(PROMPTS, 9)
    pieces = list(gen.stream(PROMPTS, 9, read_every=3))
    assert [len(p[0]) for p in pieces] == [1, 3, 3, 2]
    assert [sum((p[b] for p in pieces), []) for b in range(3)] == expected


def test_abandoned_stream_leaves_a_usable_generator(model):
    gen = Generator(model, max_len=48, eos_token_ids=[])
    expected = gen.generate(PROMPTS[2], 8)
    it = gen.stream(PROMPTS[0], 20, read_every=2)
    next(it), next(it)
    it.close()
    assert gen.cache.longest() == 0 and int(gen.cache.lens.max()) == 0  # reset, consistently
    assert gen.generate(PROMPTS[2], 8) == expected


def test_stats_describe_the_last_request(model):
    gen = Generator(model, max_len=48, eos_token_ids=[])
    gen.generate(PROMPTS, 6)
    s = gen.stats
    assert (s.prompt_tokens, s.new_tokens, s.decode_steps) == (28, 18, 5)
    assert s.prefill_s > 0 and s.decode_s > 0
    assert "ms per decoded token" in s.summary() and "tokens/s" in s.summary()


def test_steps_table_is_what_the_capture_layer_compiles():
    assert set(STEPS) == {"prefill", "first", "first_greedy", "decode", "decode_greedy"}


def test_compiled_greedy_equals_transformers(pair):
    """compile=True through the capture layer, with dynamo + AOT autograd only (no code generation: fast)."""
    hf, model = pair
    torch._dynamo.reset()
    opts = CaptureOptions(settings=CompileSettings(backend="aot_eager"), warm_up="lazy", progress=False)
    gen = Generator(model, max_len=40, chunk_size=8, compile=True, eos_token_ids=[], capture=opts)
    for p in (PROMPTS[0], PROMPTS[2]):  # a second request on the same generator
        assert gen.generate(p, 8) == hf_greedy(hf, p, 8, eos=None)


def test_compiled_steps_write_a_cache_on_huge_pages(pair):
    """A CPU cache over 2 MB lives in its own huge-page mappings (static_decode.base.hugepages): the compiled steps
    that write its K, V and lengths in place still capture (one storage shared by them, or a byte view of one, is
    refused by AOT autograd) and give transformers' tokens."""
    from static_decode.base import hugepages

    hf, model = pair
    c = model.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.dtype.itemsize
    max_len = -(-3 * hugepages.HUGE_PAGE // per_token)
    torch._dynamo.reset()
    opts = CaptureOptions(settings=CompileSettings(backend="aot_eager"), warm_up="lazy", progress=False)
    gen = Generator(model, max_len=max_len, chunk_size=8, compile=True, eos_token_ids=[], capture=opts)
    assert gen.generate(PROMPTS[0], 8) == hf_greedy(hf, PROMPTS[0], 8, eos=None)
    before = ptrs(gen)
    assert gen.generate(PROMPTS[2], 8) == hf_greedy(hf, PROMPTS[2], 8, eos=None)
    assert ptrs(gen) == before
    if sys.platform == "linux" and hugepages.thp_mode() in ("always", "madvise"):
        assert "hg" in mapping_of(gen.cache.k.data_ptr()).get("VmFlags", "").split()


@pytest.mark.slow
def test_compiled_greedy_equals_transformers_with_inductor(pair):
    hf, model = pair
    torch._dynamo.reset()
    opts = CaptureOptions(kinds=("prefill", "first_greedy", "decode_greedy"), progress=False)
    gen = Generator(model, max_len=16, chunk_size=8, compile=True, eos_token_ids=[], capture=opts)
    for p in (PROMPTS[0], PROMPTS[1]):
        assert gen.generate(p, 6) == hf_greedy(hf, p, 6, eos=None)


def test_a_trainable_model_builds_no_autograd_graph(model):
    from static_decode import Llama

    fresh = Llama(model.config)  # parameters require grad, unlike a loaded model's
    gen = Generator(fresh, max_len=32, eos_token_ids=[])
    it = gen.stream(PROMPTS[0], 6, read_every=2)
    next(it)
    assert torch.is_grad_enabled()  # the caller's grad mode between yields is untouched
    list(it)
    assert gen.cache.k.grad_fn is None and not gen.cache.k.requires_grad


def test_launches_are_wrapped_in_nvtx_ranges(model, monkeypatch):
    """The Nsight recipes select by these names: one prefill/chunk per chunk, one sample, one decode/step per step."""
    from static_decode.base import ranges

    seen: list[str] = []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self):
            seen.append(self.name)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(ranges, "range", lambda name, color=None: Recorder(name))
    gen = Generator(model, max_len=64, chunk_size=4)
    gen.generate([1, 2, 3, 4, 5, 6], 5, stop_at_eos=False)  # 2 chunks, the first token, 4 decode steps
    assert seen == [ranges.PREFILL_CHUNK] * 2 + [ranges.SAMPLE] + [ranges.DECODE_STEP] * 4


def test_flex_attention_is_refused_for_compiled_cpu_steps():
    model = Llama(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                              num_kv_heads=1), attn_impl="flex")
    with pytest.raises(ValueError, match="attn_impl='flex' compiles only on CUDA"):
        Generator(model, max_len=16, compile=True)
    eager = Generator(model, max_len=16)  # eager flex is PyTorch's reference path: slow, but correct
    sdpa = Generator(Llama(model.config, attn_impl="sdpa_folded"), max_len=16)
    sdpa.model.load_state_dict(model.state_dict())
    assert eager.generate([1, 2, 3], 5) == sdpa.generate([1, 2, 3], 5)


def test_long_chunks_prefill_the_bulk_uncompiled_and_change_no_token(pair, monkeypatch):
    """While the longest row has long_chunk tokens left, one long chunk (not a runner launch) at the exact live
    read length; the rest in chunk_size chunks through the runner. Tokens equal transformers' and long_chunk=0."""
    import static_decode.generation.host_loop as generator_module  # where the host loop looks it up

    hf, model = pair
    seen = []
    real = generator_module.prefill_long

    def spy(m, cache, bufs, read_len, fresh):
        seen.append((bufs.n_new.tolist(), read_len, bufs.long_chunk.shape[1], fresh))
        real(m, cache, bufs, read_len, fresh=fresh)

    monkeypatch.setattr(generator_module, "prefill_long", spy)
    gen = Recording(model, max_len=64, chunk_size=4, long_chunk=8, eos_token_ids=[])
    out = gen.generate(PROMPTS, 6)  # rows of 7, 2 and 19 tokens
    assert out == [hf_greedy(hf, p, 6, eos=None) for p in PROMPTS]
    assert out == Generator(model, max_len=64, chunk_size=4, long_chunk=0, eos_token_ids=[]).generate(PROMPTS, 6)
    # 19 = 8 + 8 (long, while 19 and 11 remain) + 3 (one padded short chunk); read lengths exact: 8, then 16
    assert seen == [([7, 2, 8], 8, 8, False), ([0, 0, 8], 16, 8, False)]  # ragged rows: masked attention
    assert [k for k, _ in gen.launches][:2] == ["prefill", "first_greedy"]
    seen.clear()
    # One row from empty filling the chunk: causal attention without a mask (masks.StepMask.causal), then not.
    assert gen.generate(PROMPTS[2], 6) == out[2]
    assert seen == [([8, 0, 0], 8, 8, False), ([8, 0, 0], 16, 8, False)]  # the batch-3 cache's idle rows: masked
    seen.clear()
    one = Generator(model, max_len=64, chunk_size=4, long_chunk=8, eos_token_ids=[])
    assert one.generate(PROMPTS[2], 6) == out[2]
    assert seen == [([8], 8, 8, True), ([8], 16, 8, False)]
    seen.clear()
    assert gen.generate(PROMPTS[1], 3) == hf_greedy(hf, PROMPTS[1], 3, eos=None) and not seen  # short: no long chunk


def test_long_chunks_under_compiled_steps(pair):
    hf, model = pair
    torch._dynamo.reset()
    opts = CaptureOptions(settings=CompileSettings(backend="aot_eager"), warm_up="lazy", progress=False)
    gen = Generator(model, max_len=40, chunk_size=4, long_chunk=8, compile=True, eos_token_ids=[], capture=opts)
    assert gen.generate(PROMPTS, 8) == [hf_greedy(hf, p, 8, eos=None) for p in PROMPTS]
    assert {kind for kind, _ in gen.runner.records} == {"prefill", "first_greedy", "decode_greedy"}


def test_long_chunk_checks(model):
    assert Generator(model, max_len=8).long_chunk == generator_default_long()
    assert Generator(model, max_len=8, chunk_size=512).long_chunk == 0  # the default is off past chunk_size
    assert Generator(model, max_len=8, long_chunk=0).long_chunk == 0
    with pytest.raises(ValueError, match="long_chunk=8 must exceed chunk_size=8"):
        Generator(model, max_len=8, chunk_size=8, long_chunk=8)
    with pytest.raises(ValueError, match="long_chunk"):
        Generator(model, max_len=8, long_chunk=-1)


def generator_default_long() -> int:
    from static_decode.generation.generator import DEFAULT_LONG_CHUNK

    return DEFAULT_LONG_CHUNK


def test_sampling_params_are_one_checked_value_taken_by_every_entry_point():
    """SamplingParams: checked when made, frozen; generate, stream, Conversation.send and PrefixCache.stream take
    it, or its fields as keywords over it, with the same tokens either way."""
    import dataclasses

    from static_decode import Conversation, SamplingParams
    from static_decode.generation.prefix_cache import PrefixCache

    gen = Generator(load_model(default_model_path()), max_len=64)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=4)
    prompt = list(b"def f(x):")
    want = gen.generate(prompt, 8, temperature=0.8, top_p=0.9, seed=4)
    assert gen.generate(prompt, 8, params) == want
    assert list(gen.stream(prompt, 8, params, read_every=3)) == want
    assert list(Conversation(gen).send(prompt, 8, params)) == want
    _, pieces = PrefixCache(gen).stream(prompt, 8, params)
    assert [t for p in pieces for t in p] == want
    assert gen.generate(prompt, 8, params, seed=5) == gen.generate(prompt, 8, temperature=0.8, top_p=0.9, seed=5)
    assert gen.generate(prompt, 8, params, temperature=0) == gen.generate(prompt, 8)  # options over it
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.seed = 1
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        SamplingParams(top_p=0)
    with pytest.raises(TypeError, match="unexpected sampling option 'temprature'; the options are temperature"):
        gen.generate(prompt, 4, temprature=0.5)
    with pytest.raises(TypeError, match="sampling must be a SamplingParams, got dict"):
        gen.generate(prompt, 4, {"temperature": 0.5})
    assert SamplingParams(top_k=np.int64(3), temperature=np.float32(0.5)) == SamplingParams(top_k=3, temperature=0.5)
