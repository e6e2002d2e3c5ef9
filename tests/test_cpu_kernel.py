"""The CPU decode-attention kernel (static_decode/csrc/decode_attention.cpp) against the float64 references.

Pins what attention.py promises for every formulation, on the kernel's own shapes (head_dim a multiple of the
vector width, up to 64 query rows per KV head): the offset mask of a chunk after cached tokens, query head h
reading KV head h // G, padded slots and empty rows exact zeros (never NaN), nothing past a row's visible keys
used, float32 math over float32 / bfloat16 / float16 caches, and the key axis split into work items (reads past
512 keys) combining exactly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from static_decode import StaticKVCache, cpu_kernel
from static_decode.attention import gqa_attention, grouped_attention, resolve_impl
from static_decode.reference import attention_vectorised
from tests.chunked import new_pair, schedule, to_torch

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernel did not build here")


def kernel_trial(
    rng: np.random.Generator, kv_dtype: torch.dtype, q_dtype: torch.dtype, atol: float, rtol: float
) -> int:
    hkv = int(rng.choice([1, 2, 3, 4]))
    g = int(rng.integers(1, 9))
    batch = int(rng.integers(1, 4))
    d = int(rng.choice([16, 32, 64, 128]))
    max_len = int(rng.choice([40, 300, 1100]))  # 1,100: three 512-key work items per KV head
    cache, hist = new_pair(batch, hkv, max_len, d, kv_dtype)
    finals = rng.integers(0, max_len + 1, size=batch)
    calls = 0
    for T, n in schedule(rng, finals, 8 if max_len == 40 else 200):
        T = min(T, 64 // g)  # the kernel's 64 query rows per KV head
        n = np.minimum(n, T)
        if (hist.lens + n > max_len).any():
            break
        k_new, v_new = rng.standard_normal((2, batch, hkv, T, d))
        q = rng.standard_normal((batch, hkv * g, T, d)) * 2.0
        cache.append(to_torch(k_new, kv_dtype), to_torch(v_new, kv_dtype), n)
        hist.append(k_new, v_new, n)
        read = int(rng.integers(int(cache.host_lens.max()), max_len + 1))  # a bucket: keys past the rows' lengths
        k, v = cache.layer_view(0, read)
        qt = to_torch(q, q_dtype)
        # The reference sees what the cache holds (rounded to its dtype), so only the kernel's math differs.
        kr = cache.k[0, :, :, :read].double().numpy()
        vr = cache.v[0, :, :, :read].double().numpy()
        expected = attention_vectorised(qt.double().numpy(), kr, vr, hist.lens, n)
        out = cpu_kernel.decode_attention(qt, k, v, cache.lens, cache.device_ints(n))
        assert out.shape == (batch, hkv * g, T, d) and out.dtype == q_dtype
        np.testing.assert_allclose(out.double().numpy(), expected, atol=atol, rtol=rtol)
        for b in range(batch):
            assert not out[b, :, n[b]:].any(), "padded slots must be exact zeros"
        calls += 1
    return calls


def test_float32_random_chunks_match_float64_reference() -> None:
    """The 300 random chunked trials every formulation runs (up to 1,100 keys, 64 rows, head_dim 16-128), in
    float32 throughout (the kernel's math; the float64 trials in test_attention.py resolve it to sdpa_folded)."""
    rng = np.random.default_rng(5)
    calls = sum(kernel_trial(rng, torch.float32, torch.float32, atol=2e-5, rtol=1e-5) for _ in range(300))
    assert calls > 750


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_cache_float32_math(kv_dtype: torch.dtype) -> None:
    """A bfloat16 / float16 cache with float32 queries: the kernel widens each key row and does float32 math, so
    against the reference over the same rounded K/V it is as close as float32 throughout."""
    rng = np.random.default_rng(6)
    calls = sum(kernel_trial(rng, kv_dtype, torch.float32, atol=2e-5, rtol=1e-5) for _ in range(40))
    assert calls > 100


def test_bfloat16_queries_round_only_the_output() -> None:
    rng = np.random.default_rng(8)
    assert sum(kernel_trial(rng, torch.bfloat16, torch.bfloat16, atol=2e-2, rtol=1e-2) for _ in range(30)) > 50


def test_keys_past_the_visible_prefix_are_never_used() -> None:
    """NaN in every cache slot past a row's length (inside the read) and huge logits: outputs stay finite and
    equal the reference over the live keys only; a row with no keys, and its padded slots, are zeros."""
    cache = StaticKVCache(3, 2, 1200, 64, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    cache.append(*(torch.randn(3, 2, 1100, 64, generator=gen) for _ in range(2)), [1100, 700, 0])
    lens = cache.host_lens.copy()
    for b in range(3):
        cache.k[0, b, :, lens[b]:] = math.nan
        cache.v[0, b, :, lens[b]:] = math.nan
    cache.append(*(torch.randn(3, 2, 2, 64, generator=gen) for _ in range(2)), [2, 1, 0])
    q = torch.randn(3, 6, 2, 64, generator=gen) * 30.0  # logits in the thousands: the running max must hold
    k, v = cache.layer_view(0, 1200)
    out = cpu_kernel.decode_attention(q, k, v, cache.lens, cache.device_ints([2, 1, 0]))
    assert not out.isnan().any()
    kr, vr = (x[0].double().nan_to_num(0.0).numpy() for x in (cache.k, cache.v))
    n = np.array([2, 1, 0])
    ref = attention_vectorised(q.double().numpy(), kr[:, :, :1200], vr[:, :, :1200], cache.host_lens, n)
    np.testing.assert_allclose(out.double().numpy(), ref, atol=1e-4, rtol=1e-5)
    assert not out[1, :, 1:].any() and not out[2].any()


def test_gqa_attention_routes_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" and the named impl run the kernel for a decode step on the CPU; float64 (not a kernel dtype) and a
    prefill chunk take the general formulation; the results agree with "matmul"."""
    calls = []
    real = cpu_kernel.decode_attention
    monkeypatch.setattr(cpu_kernel, "decode_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    cache = StaticKVCache(1, 3, 256, 64, dtype=torch.float32)
    cache.append(torch.randn(1, 3, 200, 64), torch.randn(1, 3, 200, 64), [200])
    q = torch.randn(1, 9, 1, 64)
    for impl in ("auto", "decode_kernel"):
        out = gqa_attention(q, cache, [1], impl=impl)
        torch.testing.assert_close(out, gqa_attention(q, cache, [1], impl="matmul"))
    assert calls == [(1, 9, 1, 64)] * 2
    cpu = torch.device("cpu")
    assert resolve_impl("auto", 1, 3, 3, cpu, 64, torch.float32) == "decode_kernel"
    assert resolve_impl("auto", 4, 8, 32, cpu, 128, torch.bfloat16) == "decode_kernel"
    assert resolve_impl("auto", 1, 3, 3 * 128, cpu, 64, torch.float32) != "decode_kernel"  # a prefill chunk
    assert resolve_impl("decode_kernel", 1, 3, 3, cpu, 64, torch.float64) == "sdpa_folded"
    assert resolve_impl("decode_kernel", 1, 3, 3, cpu, 24, torch.float32) == "sdpa_folded"  # head_dim 24
    assert resolve_impl("auto", 1, 3, 3, torch.device("cuda"), 64, torch.float32) == "sdpa_folded"


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setenv(cpu_kernel.ENV, "0")
    assert not cpu_kernel.available()
    assert resolve_impl("auto", 1, 3, 3, torch.device("cpu"), 64, torch.float32) in ("split_key", "sdpa_folded")


def test_compiled_call_matches_eager() -> None:
    """The op traces through its Meta kernel (fullgraph: no graph break) and the compiled step runs the kernel."""
    cache = StaticKVCache(2, 3, 640, 64, dtype=torch.float32)
    cache.append(torch.randn(2, 3, 600, 64), torch.randn(2, 3, 600, 64), [600, 313])
    cache.append(torch.randn(2, 3, 1, 64), torch.randn(2, 3, 1, 64), [1, 1])
    q = torch.randn(2, 9, 1, 64)
    n = cache.device_ints([1, 1])
    k, v = cache.layer_view(0, 640)

    def step(q, k, v, lens, n_new):
        return grouped_attention(q, k, v, lens, n_new, impl="auto") * 2

    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, cache.lens, n), step(q, k, v, cache.lens, n), atol=0, rtol=0)


def test_unsupported_shapes_are_refused_by_name() -> None:
    k = v = torch.zeros(1, 1, 8, 24)
    with pytest.raises(RuntimeError, match="head_dim 24"):
        torch.ops.static_decode_cpu.decode_attention(torch.zeros(1, 1, 1, 24), k, v, torch.ones(1, dtype=torch.int64),
                                                 torch.ones(1, dtype=torch.int64), 1, 1.0)


# ---- the bfloat16 one-row product (csrc/gemv_bf16.cpp) ---------------------------------------------------------
needs_bf16_dot = pytest.mark.skipif(not cpu_kernel.bf16_dot(), reason="this CPU has no AVX512-BF16")


@needs_bf16_dot
@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 77), (8, 576), (9, 1536), (1001, 64), (4099, 576)])
def test_gemv_matches_float64_on_bfloat16_values(n: int, k: int) -> None:
    """Every row, any K (a tail past a multiple of 32 read masked), N not a multiple of the 8-row step: float32
    accumulation of exact bfloat16 products against float64. The row comes in float32 (bfloat16 values), so the
    output is not rounded: the tolerance is float32's."""
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(k, generator=gen).bfloat16().float()
    got = cpu_kernel.gemv_bf16(x, w)
    assert got.shape == (n,) and got.dtype == torch.float32
    want = w.double() @ x.double()
    torch.testing.assert_close(got.double(), want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
    out16 = cpu_kernel.gemv_bf16(x.bfloat16(), w)  # a bfloat16 row: the output rounds to bfloat16
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16, want.bfloat16(), atol=0, rtol=2 ** -7)


@needs_bf16_dot
def test_projection_routes_one_bfloat16_row_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from static_decode import projection

    calls = []
    real = cpu_kernel.gemv_bf16
    monkeypatch.setattr(cpu_kernel, "gemv_bf16", lambda x, w: calls.append(tuple(w.shape)) or real(x, w))
    w, b = torch.randn(40, 64).bfloat16(), torch.randn(40).bfloat16()
    one, two = torch.randn(1, 1, 64).bfloat16(), torch.randn(1, 2, 64).bfloat16()
    out = projection.linear(one, w, b)
    assert out.shape == (1, 1, 40) and calls == [(40, 64)]
    torch.testing.assert_close(out, torch.nn.functional.linear(one, w, b), atol=0.05, rtol=0.02)
    projection.linear(two, w)  # a chunk of two rows: the GEMM
    projection.linear(one.float(), w.float())  # float32: MKL's GEMV
    projection.linear(one, w.t().contiguous().t())  # a non-contiguous weight
    assert calls == [(40, 64)]


@needs_bf16_dot
def test_gemv_compiles_without_a_graph_break() -> None:
    from static_decode import projection

    w = torch.randn(300, 96).bfloat16()
    x = torch.randn(1, 96).bfloat16()
    fn = torch.compile(lambda x, w: projection.linear(torch.relu(x), w) * 2, fullgraph=True)
    torch.testing.assert_close(fn(x, w), projection.linear(torch.relu(x), w) * 2, atol=0, rtol=0)


@needs_bf16_dot
def test_gemv_refuses_a_float32_weight_by_name() -> None:
    with pytest.raises(RuntimeError, match="gemv_bf16: .*bfloat16.*Float"):
        torch.ops.static_decode_cpu.gemv_bf16(torch.zeros(8), torch.zeros(4, 8))


def test_a_cpu_generator_builds_the_kernels_before_any_timed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-time build happens when the Generator is made, not inside the first step's timing."""
    from static_decode import Generator
    from static_decode.loading import default_model_path, load_model

    builds = []
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setattr(cpu_kernel, "_build", lambda: builds.append(1))
    Generator(load_model(default_model_path()), max_len=64, compile=False)
    assert builds == [1] and cpu_kernel._state == {"ok": True}
