"""gqa_attention against the numpy references (rules 2, 3 and 5).

Pins: the offset causal mask of a chunk appended after cached tokens (a chunk-only T x T triangle passes decode
and full prefill but fails here), query head h reading KV head h // G, padded slots and empty rows giving exact
zeros (never NaN, even with extreme logits), and the read being a view of the buffer up to read_len.
"""

import numpy as np
import pytest
import torch

from static_decode import StaticKVCache, gqa_attention
from static_decode.core.attention import DEFAULT_IMPL, IMPLS
from static_decode.core.masks import chunk_mask
from static_decode.core.reference import attention_direct, attention_vectorised
from tests.support.chunked import new_pair, schedule, to_torch


def run_trial(rng: np.random.Generator, impl: str, dtype: torch.dtype, atol: float, rtol: float = 0.0) -> int:
    hkv = int(rng.choice([1, 2, 4]))
    g = int(rng.integers(1, 9))
    batch, d, max_len = int(rng.integers(1, 4)), int(rng.choice([4, 8, 16])), 40
    cache, hist = new_pair(batch, hkv, max_len, d, dtype)
    finals = rng.integers(0, max_len + 1, size=batch)
    calls = 0
    for T, n in schedule(rng, finals, 8):
        k_new, v_new = rng.standard_normal((2, batch, hkv, T, d))
        q = rng.standard_normal((batch, hkv * g, T, d)) * 2.0
        cache.append(to_torch(k_new, dtype), to_torch(v_new, dtype), n)
        hist.append(k_new, v_new, n)
        # The reference sees what the cache holds (rounded to dtype), so only the attention math differs.
        kr = cache.k[0, :, :, :max_len].double().numpy()
        vr = cache.v[0, :, :, :max_len].double().numpy()
        qt = to_torch(q, dtype)
        expected = attention_vectorised(qt.double().numpy(), kr, vr, hist.lens, n)
        out = gqa_attention(qt, cache, n, impl=impl)
        assert out.shape == (batch, hkv * g, T, d) and out.dtype == dtype
        np.testing.assert_allclose(out.double().numpy(), expected, atol=atol, rtol=rtol)
        for b in range(batch):
            assert not out[b, :, n[b]:].any(), "padded slots must be exact zeros"
        calls += 1
    np.testing.assert_array_equal(cache.host_lens, finals)
    np.testing.assert_array_equal(cache.lens.numpy(), finals)
    return calls


@pytest.mark.parametrize(("impl", "trials"), [(DEFAULT_IMPL, 300)] + [(i, 100) for i in IMPLS if i != DEFAULT_IMPL])
def test_float64_matches_references(impl: str, trials: int) -> None:
    """The default impl over 300 random chunked trials, each alternative over 100."""
    rng = np.random.default_rng(7)
    calls = sum(run_trial(rng, impl, torch.float64, atol=1e-10) for _ in range(trials))
    assert calls > trials


@pytest.mark.parametrize("block", [1, 4])
def test_split_key_blocks_combine_exactly(monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    """split_key with blocks small enough that the random reads split (block 1: every key its own block, so the
    log-sum-exp combine does all the work), over the same random chunked trials and references."""
    import static_decode.core.split_attention as split

    monkeypatch.setattr(split, "SPLIT_BLOCK", block)
    rng = np.random.default_rng(17 + block)
    calls = sum(run_trial(rng, "split_key", torch.float64, atol=1e-10) for _ in range(100))
    assert calls > 100


@pytest.mark.parametrize("batch", [1, 3])
def test_split_key_reads_the_cache_in_place(batch: int) -> None:
    """The blocks are strided views of the cache: the kernel gets K and V at the cache's own addresses."""
    import static_decode.core.split_attention as split

    cache = StaticKVCache(batch, 2, 520, 8, dtype=torch.float32)  # 520: a spare tail past the 512 read
    cache.append(torch.randn(batch, 2, 300, 8), torch.randn(batch, 2, 300, 8), [300] * batch)
    seen = []
    real = split.block_partials

    def spy(q, k, v, bias, scale):
        seen.append((k.data_ptr(), v.data_ptr(), tuple(k.shape), k.stride()))
        return real(q, k, v, bias, scale)

    split.block_partials = spy
    try:
        q = torch.randn(batch, 4, 1, 8)
        out = gqa_attention(q, cache, [1] * batch, read_len=512, impl="split_key")  # slot 0 at 299: 3 live blocks
    finally:
        split.block_partials = real
    ref = gqa_attention(q, cache, [1] * batch, read_len=512, impl="matmul")
    row = cache.k.stride(2)  # B and Hkv merged: one KV head's whole allocation apart
    assert seen == [(cache.k.data_ptr(), cache.v.data_ptr(), (batch * 2, 4, 128, 8), (row, 128 * 8, 8, 1))]
    assert out.abs().sum() > 0
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), [(torch.float32, 2e-5, 1e-5), (torch.bfloat16, 8e-2, 5e-2)])
def test_low_precision_against_float64(dtype: torch.dtype, atol: float, rtol: float) -> None:
    """Stated tolerances: float32 within 2e-5 abs + 1e-5 rel; bfloat16 within 8e-2 abs + 5e-2 rel.

    bfloat16 keeps 8 mantissa bits: logits near 8 round by ~0.03, so softmax weights move by ~3%."""
    rng = np.random.default_rng(11)
    for _ in range(40):
        run_trial(rng, DEFAULT_IMPL, dtype, atol=atol, rtol=rtol)


@pytest.mark.parametrize("impl", IMPLS)
def test_long_chunk_after_long_history(impl: str) -> None:
    """512 tokens appended after 3,000 cached ones: every chunk query must see all 3,000 old keys."""
    rng = np.random.default_rng(3)
    hkv, g, d = 2, 4, 16
    cache = StaticKVCache(1, hkv, 4096, d, dtype=torch.float64)
    k0, v0 = rng.standard_normal((2, 1, hkv, 3000, d))
    cache.append(to_torch(k0, torch.float64), to_torch(v0, torch.float64), [3000])
    k1, v1 = rng.standard_normal((2, 1, hkv, 512, d))
    q = rng.standard_normal((1, hkv * g, 512, d))
    cache.append(to_torch(k1, torch.float64), to_torch(v1, torch.float64), [512])
    out = gqa_attention(to_torch(q, torch.float64), cache, [512], impl=impl).numpy()
    k, v = np.concatenate([k0, k1], axis=2), np.concatenate([v0, v1], axis=2)
    lens, n = np.array([3512]), np.array([512])
    np.testing.assert_allclose(out, attention_vectorised(q, k, v, lens, n), atol=1e-10, rtol=0)
    np.testing.assert_allclose(out, attention_direct(q, k, v, lens, n), atol=1e-10, rtol=0)
    ref_tri = attention_vectorised(q, k[:, :, 3000:], v[:, :, 3000:], np.array([512]), n)  # the triangle bug
    assert np.abs(out - ref_tri).max() > 1e-3, "a chunk-only triangle would give a different answer"


@pytest.mark.parametrize("impl", IMPLS)
def test_extreme_logits_give_zeros_not_nan(impl: str) -> None:
    """q = 64·1 and k = -64·1: huge negative logits. Padded slots and empty rows are exactly zero."""
    d, hkv, g = 128, 2, 4
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        cache = StaticKVCache(3, hkv, 16, d, dtype=dtype)
        kn = torch.full((3, hkv, 4, d), -64.0, dtype=dtype)
        vn = torch.randn(3, hkv, 4, d).to(dtype)
        cache.append(kn, vn, [4, 2, 0])
        q = torch.full((3, hkv * g, 4, d), 64.0, dtype=dtype)
        out = gqa_attention(q, cache, [4, 2, 0], impl=impl)
        assert not out.isnan().any() and not out.isinf().any()
        assert not out[1, :, 2:].any() and not out[2].any()
        # Real slots: softmax of equal logits is uniform over the visible keys.
        expected = vn[0, :, :2].double().mean(dim=1)  # slot 1 of row 0 sees keys 0..1
        got = out[0, :, 1].double().view(hkv, g, d)
        torch.testing.assert_close(got, expected[:, None].expand(hkv, g, d), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch_and_empty_cache(impl: str) -> None:
    empty = StaticKVCache(0, 2, 8, 4)
    out = gqa_attention(torch.randn(0, 4, 3, 4), empty, [], impl=impl)
    assert out.shape == (0, 4, 3, 4)
    cache = StaticKVCache(2, 2, 8, 4)
    out = gqa_attention(torch.randn(2, 4, 3, 4), cache, [0, 0], impl=impl)
    assert out.shape == (2, 4, 3, 4) and not out.any() and not out.isnan().any()


def test_read_is_a_view_up_to_read_len(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = StaticKVCache(1, 2, 64, 8, layers=3)
    seen = []
    import static_decode.core.attention as attention_module

    real = attention_module.grouped_attention

    def spy(q, k, v, lens, n_new, **kw):
        seen.append((k, v))
        return real(q, k, v, lens, n_new, **kw)

    monkeypatch.setattr(attention_module, "grouped_attention", spy)
    cache.host_lens[:] = 5
    cache.lens.fill_(5)
    gqa_attention(torch.randn(1, 4, 1, 8), cache, [1], layer=2)
    gqa_attention(torch.randn(1, 4, 1, 8), cache, [1], layer=1, read_len=32)
    (k1, v1), (k2, v2) = seen
    assert k1.shape[2] == 5 and k2.shape[2] == 32  # default read_len = longest row; else as asked
    for k, buf, layer in ((k1, cache.k, 2), (v1, cache.v, 2), (k2, cache.k, 1), (v2, cache.v, 1)):
        assert k._base is buf or k.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert k.data_ptr() == buf[layer].data_ptr()  # a view into that layer, not a copy


def test_chunk_mask_offsets() -> None:
    """Row 0: 2 new tokens after 3 cached (positions 3, 4); row 1: nothing new; row 2: 1 token, a fresh row."""
    mask = chunk_mask(torch.tensor([5, 4, 1]), torch.tensor([2, 0, 1]), 3, 6)
    expected = torch.zeros(3, 3, 6, dtype=torch.bool)
    expected[0, 0, :4] = True
    expected[0, 1, :5] = True
    expected[2, 0, :1] = True
    assert torch.equal(mask, expected)


def test_read_len_checks() -> None:
    cache = StaticKVCache(1, 1, 8, 4)
    cache.append(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), [3])
    q = torch.randn(1, 2, 1, 4)
    with pytest.raises(ValueError, match="read_len=2"):
        gqa_attention(q, cache, [1], read_len=2)  # would hide the third key
    with pytest.raises(ValueError, match="read_len=9"):
        gqa_attention(q, cache, [1], read_len=9)
    with pytest.raises(ValueError, match="impl"):
        gqa_attention(q, cache, [1], impl="flash")


@pytest.mark.parametrize("T", [1, 8])
def test_sdpa_folded_accepts_cuda_output_layout(monkeypatch: pytest.MonkeyPatch, T: int) -> None:
    """CUDA's fused SDPA kernels return [B, H, L, d] laid out as [B, L, H, d]; a `.view` merging (Hkv, G) into
    Hq fails on that layout (seen on an H200: every compiled prefill chunk failed). Emulated here on the CPU."""
    import torch.nn.functional as F

    import static_decode.core.attention as attention_module

    real_sdpa = F.scaled_dot_product_attention

    def cuda_layout_sdpa(*args, **kw):
        out = real_sdpa(*args, **kw)  # [B, Hkv, G*T, d]
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strides of [B, G*T, Hkv, d]

    rng = np.random.default_rng(3)
    batch, hkv, g, d = 3, 2, 2, 8
    cache = StaticKVCache(batch, hkv, 32, d, dtype=torch.float64)
    n = [T, max(T - 3, 0), 1]
    k_new, v_new = (torch.from_numpy(x) for x in rng.standard_normal((2, batch, hkv, T, d)))
    cache.append(k_new, v_new, n)
    q = torch.from_numpy(rng.standard_normal((batch, hkv * g, T, d)))
    expected = gqa_attention(q, cache, n, impl="matmul")
    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", cuda_layout_sdpa)
    out = gqa_attention(q, cache, n, impl="sdpa_folded")
    compiled = torch.compile(attention_module.grouped_attention, backend="aot_eager", fullgraph=True)
    k, v = cache.layer_view(0, cache.max_len)
    out_c = compiled(q, k, v, cache.lens, torch.tensor(n), impl="sdpa_folded")
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(out_c, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("g", [1, 2, 3])
def test_a_fresh_chunk_runs_causal_and_equals_the_reference(g: int) -> None:
    """StepMask.causal (a chunk from position 0 filling every slot, read == T): per-group causal SDPA, exactly
    rule 3 against the float64 reference; a read longer than the chunk is refused."""
    import static_decode.core.attention as attention_module
    from static_decode.core.attention import grouped_attention
    from static_decode.core.masks import FRESH

    rng = np.random.default_rng(g)
    batch, hkv, T, d = 2, 2, 11, 8
    cache, hist = new_pair(batch, hkv, 16, d, torch.float64)
    k_new, v_new = rng.standard_normal((2, batch, hkv, T, d))
    q = rng.standard_normal((batch, hkv * g, T, d))
    cache.append(to_torch(k_new, torch.float64), to_torch(v_new, torch.float64), [T, T])
    hist.append(k_new, v_new, [T, T])
    k, v = cache.layer_view(0, T)
    expected = attention_vectorised(q, k.numpy(), v.numpy(), hist.lens, [T, T])
    n_new = torch.tensor([T, T])
    out = grouped_attention(torch.from_numpy(q), k, v, cache.lens, n_new, mask=FRESH)
    np.testing.assert_allclose(out.numpy(), expected, atol=1e-12, rtol=0)
    per_group = attention_module._causal_per_group(torch.from_numpy(q), k, v)  # the form used off the CPU
    np.testing.assert_allclose(per_group.numpy(), expected, atol=1e-12, rtol=0)
    k, v = cache.layer_view(0, T + 1)
    with pytest.raises(ValueError, match="reads exactly its own 11 keys, got a read of 12"):
        grouped_attention(torch.from_numpy(q), k, v, cache.lens, n_new, mask=FRESH)


def test_a_fresh_chunk_reads_k_and_v_in_place() -> None:
    """Rule 2 on the causal path: no repeat, no copy of K or V (the CPU kernel maps the GQA heads itself)."""
    from torch.profiler import ProfilerActivity, profile

    from static_decode.core.attention import grouped_attention
    from static_decode.core.masks import FRESH

    T, d = 64, 16
    k, v = torch.randn(2, 1, 3, T + 1, d)[:, :, :, :T]  # [1, Hkv, T, d] strided like the cache
    q = torch.randn(1, 9, T, d)
    lens = torch.tensor([T])
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        grouped_attention(q, k, v, lens, lens, mask=FRESH)
    copies = [
        (ev.name, shape)
        for ev in prof.events()
        if ev.name in {"aten::copy_", "aten::clone", "aten::repeat_interleave", "aten::repeat", "aten::contiguous"}
        for shape in ev.input_shapes
        if len(shape) >= 2 and tuple(shape[-2:]) == (T, d) and shape[-3:-2] != [9]
    ]
    assert not copies


def test_auto_resolves_per_device_batch_and_kv_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" without the CPU kernel (tests/kernels/test_cpu_kernel.py checks it with): split_key on the CPU when
    batch x KV heads does not divide over the threads, else sdpa_folded."""
    from static_decode.core.attention import resolve_impl
    from static_decode.kernels import cpu_kernel

    monkeypatch.setattr(cpu_kernel, "_state", {"ok": False})
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert resolve_impl("auto", 1, 3, 3, cpu) == "split_key"  # SmolLM2 decode: 3 KV heads on 2 threads
        assert resolve_impl("auto", 1, 3, 32, cpu) == "split_key"  # a short verify chunk: one query block
        assert resolve_impl("auto", 1, 3, 3 * 128, cpu) == "sdpa_folded"  # a prefill chunk: query blocks enough
        assert resolve_impl("auto", 1, 8, 4, cpu) == resolve_impl("auto", 2, 3, 3, cpu) == "sdpa_folded"
        assert resolve_impl("auto", 1, 3, 3, cuda) == "split_key"  # eager CUDA decode: split keys (flex compiled)
        assert resolve_impl("auto", 1, 3, 3 * 128, cuda) == "sdpa_folded"  # a CUDA prefill chunk
        assert resolve_impl("matmul", 1, 3, 3, cpu) == "matmul"  # a named formulation is kept
        torch.set_num_threads(1)
        assert resolve_impl("auto", 1, 3, 3, cpu) == "sdpa_folded"
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="impl must be one of"):
        gqa_attention(torch.randn(1, 4, 1, 8), StaticKVCache(1, 2, 8, 8), [0], impl="fastest")


def test_the_thread_count_is_a_constant_of_the_trace() -> None:
    """attention._threads carries the marker torch.compiler.assume_constant_result sets (set by hand there, so
    importing attention does not import torch._dynamo), and a fullgraph compile that reads it traces."""
    import static_decode.core.attention as attention

    marked = torch.compiler.assume_constant_result(lambda: 0)
    assert {k for k in vars(marked)} <= set(vars(attention._threads)) and attention._threads._dynamo_marked_constant

    def pick(x: torch.Tensor) -> torch.Tensor:
        impl = attention.resolve_impl("auto", x.shape[0], 3, 3, x.device)
        return x + (1 if impl == "split_key" else 2)

    want = pick(torch.zeros(1))
    assert torch.equal(torch.compile(pick, fullgraph=True, backend="eager")(torch.zeros(1)), want)


def test_split_key_cuda_partials_logic_on_cpu() -> None:
    """The CUDA branch (memory-efficient kernel: a full-shape bias, log-sum-exp padded to 32 rows) with a reference
    kernel standing in, against the CPU flash branch on the same blocks."""
    import math

    import static_decode.core.split_attention as split

    seen = {}

    def reference(q, k, v, bias, lse_wanted, dropout, causal, *, scale):
        seen["bias"] = tuple(bias.shape)
        s = (q.double() @ k.double().transpose(-1, -2)) * scale + bias.double()  # [N, nb, M, Sb]
        lse = torch.logsumexp(s, dim=-1)  # [N, nb, M]
        out = torch.softmax(s, dim=-1) @ v.double()
        pad = torch.full((*lse.shape[:-1], 32 - lse.shape[-1]), float("nan"), dtype=lse.dtype)
        return out.to(q.dtype), torch.cat([lse, pad], dim=-1).float(), None, None

    N, nb, M, Sb, d = 3, 4, 3, 8, 16
    q = torch.randn(N, 1, M, d).expand(N, nb, M, d)
    k, v = torch.randn(2, N, nb, Sb, d)
    bias = torch.where(torch.rand(1, nb, M, Sb) < 0.8, 0.0, -math.inf)
    bias[..., 0] = 0.0  # every row sees a key in every block
    out, lse = split.efficient_partials(q, k, v, bias, d ** -0.5, reference)
    want_out, want_lse = split.block_partials(q, k, v, bias, d ** -0.5)  # the CPU flash kernel
    assert seen["bias"] == (N, nb, M, Sb) and lse.shape == (N, nb, M)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


# ---- CUDA decode and verify steps: the key-splitting formulations ----------------------------------------------
@pytest.mark.parametrize("impl", ["flex", "split_key"])
@pytest.mark.parametrize("T", [1, 4])
def test_cuda_decode_formulations_match_the_reference(monkeypatch: pytest.MonkeyPatch, impl: str, T: int) -> None:
    """What a CUDA decode (T=1) or verify (T=4) step runs, at its shape there: a power-of-two group (flex's
    constraint), head_dim 16, a read of whole blocks past the live keys, ragged rows of which one appends nothing
    (padded: all zeros) and one a partial chunk; small split blocks so that the combine spans several. Against the
    float64 numpy reference, on the CPU (flex: PyTorch's eager reference of the same score_mod)."""
    import static_decode.core.split_attention as split
    from static_decode.core.attention import grouped_attention

    monkeypatch.setattr(split, "SPLIT_BLOCK", 8)
    rng = np.random.default_rng(11 + T)
    B, hkv, g, d, S = 3, 2, 4, 16, 48
    k, v = torch.from_numpy(rng.standard_normal((2, B, hkv, S + 1, d)))  # [B, Hkv, S + spare, d]
    q = torch.from_numpy(rng.standard_normal((B, hkv * g, T, d)) * 3.0)
    lens = torch.tensor([37, 9 + T, 5])
    n_new = torch.tensor([T, max(T - 1, 1) if T > 1 else 1, 0])  # row 2 appends nothing: every slot padded
    kr, vr = k[:, :, :S], v[:, :, :S]  # strided views, as the cache's
    out = grouped_attention(q, kr, vr, lens, n_new, impl=impl)
    want = attention_vectorised(q.numpy(), kr.numpy(), vr.numpy(), lens.numpy(), n_new.numpy())
    np.testing.assert_allclose(out.numpy(), want, atol=1e-10)
    assert not out[2].any() and (T == 1 or not out[1, :, int(n_new[1]):].any())
