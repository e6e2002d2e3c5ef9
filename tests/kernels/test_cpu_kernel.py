"""The CPU decode-attention kernel (static_decode/kernels/csrc/decode_attention.cpp) against the float64 references.

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

from static_decode import StaticKVCache
from static_decode.core.attention import gqa_attention, grouped_attention, resolve_impl
from static_decode.core.reference import attention_vectorised
from static_decode.kernels import cpu_kernel
from tests.support.chunked import new_pair, schedule, to_torch

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


@pytest.mark.parametrize("threads", [1, 3, 4])
def test_every_split_plan_matches_the_reference(threads: int) -> None:
    """The key axis splits by the longest visible prefix and the thread count (more, equal work items until every
    thread has as many): at 1, 3 and 4 threads the plans differ (3 KV heads on 4 threads: 4 items per head) and
    every one must still combine to the float64 reference, rows of different lengths in one batch included."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = np.random.default_rng(10 + threads)
        calls = sum(kernel_trial(rng, torch.float32, torch.float32, atol=2e-5, rtol=1e-5) for _ in range(40))
    finally:
        torch.set_num_threads(before)
    assert calls > 100


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_past_the_visible_prefix_are_never_used(dtype: torch.dtype) -> None:
    """NaN in every cache slot past a row's length (inside the read) and huge logits: outputs stay finite and
    equal the reference over the live keys only; a row with no keys, and its padded slots, are zeros. bfloat16
    queries over a bfloat16 cache take the dot-product path, which reads the cache's rows itself."""
    cache = StaticKVCache(3, 2, 1200, 64, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    cache.append(*(torch.randn(3, 2, 1100, 64, generator=gen).to(dtype) for _ in range(2)), [1100, 700, 0])
    lens = cache.host_lens.copy()
    for b in range(3):
        cache.k[0, b, :, lens[b]:] = math.nan
        cache.v[0, b, :, lens[b]:] = math.nan
    cache.append(*(torch.randn(3, 2, 2, 64, generator=gen).to(dtype) for _ in range(2)), [2, 1, 0])
    q = (torch.randn(3, 6, 2, 64, generator=gen) * 30.0).to(dtype)  # logits in the thousands: the max must hold
    k, v = cache.layer_view(0, 1200)
    out = cpu_kernel.decode_attention(q, k, v, cache.lens, cache.device_ints([2, 1, 0]))
    assert not out.isnan().any()
    kr, vr = (x[0].double().nan_to_num(0.0).numpy() for x in (cache.k, cache.v))
    n = np.array([2, 1, 0])
    ref = attention_vectorised(q.double().numpy(), kr[:, :, :1200], vr[:, :, :1200], cache.host_lens, n)
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    np.testing.assert_allclose(out.double().numpy(), ref, **tol)
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
    # Off the CPU the kernel does not apply: a CUDA decode step splits the key axis (eager: split_key)
    assert resolve_impl("auto", 1, 3, 3, torch.device("cuda"), 64, torch.float32) == "split_key"


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
needs_bf16_rows = pytest.mark.skipif(not cpu_kernel.bf16_rows(), reason="this CPU has neither AVX512-BF16 nor AVX2")


@needs_bf16_rows
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


@needs_bf16_rows
def test_projection_routes_one_bfloat16_row_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from static_decode.model import projection

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


@needs_bf16_rows
def test_gemv_compiles_without_a_graph_break() -> None:
    from static_decode.model import projection

    w = torch.randn(300, 96).bfloat16()
    x = torch.randn(1, 96).bfloat16()
    fn = torch.compile(lambda x, w: projection.linear(torch.relu(x), w) * 2, fullgraph=True)
    torch.testing.assert_close(fn(x, w), projection.linear(torch.relu(x), w) * 2, atol=0, rtol=0)


@needs_bf16_rows
def test_gemv_refuses_a_float32_weight_by_name() -> None:
    with pytest.raises(RuntimeError, match="gemv_bf16: .*bfloat16.*Float"):
        torch.ops.static_decode_cpu.gemv_bf16(torch.zeros(8), torch.zeros(4, 8))


def test_a_cpu_generator_builds_the_kernels_before_any_timed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-time build happens when the Generator is made, not inside the first step's timing."""
    from static_decode import Generator
    from static_decode.checkpoints.loading import default_model_path, load_model

    builds = []
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setattr(cpu_kernel, "_build", lambda: builds.append(1))
    Generator(load_model(default_model_path()), max_len=64, compile=False)
    assert builds == [1] and cpu_kernel._state == {"ok": True}


# ---- fused calls: q/k/v in one, SwiGLU's gate/up/silu in one ------------------------------------------------------
@needs_bf16_rows
@pytest.mark.parametrize(("k", "ns"), [(576, (576, 192, 192)), (77, (5, 8, 17)), (64, (1, 1, 1)), (96, (130, 9, 64))])
def test_cat3_is_the_three_products_concatenated(k: int, ns: tuple[int, int, int]) -> None:
    """Row blocks of three matrices in one parallel range (a block never spans two): every value exactly what
    gemv_bf16 gives it, in a float32 or a bfloat16 row, and each against float64."""
    gen = torch.Generator().manual_seed(k)
    ws = [torch.randn(n, k, generator=gen).bfloat16() for n in ns]
    for x in (torch.randn(k, generator=gen).bfloat16(), torch.randn(k, generator=gen).bfloat16().float()):
        got = cpu_kernel.gemv_bf16_cat3(x, *ws)
        assert got.shape == (sum(ns),) and got.dtype == x.dtype
        assert torch.equal(got, torch.cat([cpu_kernel.gemv_bf16(x, w) for w in ws]))
        want = torch.cat([w.double() @ x.double() for w in ws])
        torch.testing.assert_close(got.double(), want, atol=1e-5 * want.abs().max().item(), rtol=2 ** -7)


@needs_bf16_rows
@pytest.mark.parametrize(("n", "k"), [(1536, 576), (17, 77), (1, 32), (40, 64)])
def test_glu_is_silu_of_the_rounded_gate_times_the_rounded_up(n: int, k: int) -> None:
    """Each product rounded to the row's dtype first (what two gemv_bf16 calls give), then silu(g) * u in float64
    and rounded once: a bfloat16 output may differ from it by one rounding, no more; a float32 one by the few
    float32 roundings of the silu itself. The row count is not a multiple of the 16-row step for most shapes."""
    gen = torch.Generator().manual_seed(n + k)
    gate, up = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16()
    for x in (torch.randn(k, generator=gen).bfloat16(), torch.randn(k, generator=gen).bfloat16().float()):
        got = cpu_kernel.gemv_bf16_glu(x, gate, up)
        assert got.shape == (n,) and got.dtype == x.dtype
        g, u = cpu_kernel.gemv_bf16(x, gate).double(), cpu_kernel.gemv_bf16(x, up).double()
        want = (g * torch.sigmoid(g) * u).to(x.dtype)
        eps = torch.finfo(x.dtype).eps * (1 if x.dtype == torch.bfloat16 else 8)
        torch.testing.assert_close(got, want, atol=1e-30, rtol=eps)


@needs_bf16_rows
def test_model_routes_a_decode_row_to_the_fused_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bfloat16 one-token step: one q/k/v call and one gate/up call per layer, and its logits match those of the
    same step with every projection apart (each through gemv_bf16) to bfloat16 rounding: eager F.silu rounds its
    output to bfloat16 before the multiply, the fused call rounds once (as inductor's fused kernel does)."""
    from static_decode.checkpoints.loading import default_model_path, load_model
    from static_decode.model import projection

    # q/k/v and gate/up as separate weights (the joined weights of the default are one product each: see
    # tests/model/test_fused_projections.py)
    model = load_model(default_model_path(), dtype=torch.bfloat16, fused_projections=False)
    calls: list[str] = []
    real_cat3, real_glu = cpu_kernel.gemv_bf16_cat3, cpu_kernel.gemv_bf16_glu
    monkeypatch.setattr(cpu_kernel, "gemv_bf16_cat3", lambda *a: calls.append("qkv") or real_cat3(*a))
    monkeypatch.setattr(cpu_kernel, "gemv_bf16_glu", lambda *a: calls.append("glu") or real_glu(*a))

    def step() -> torch.Tensor:
        cache = model.new_cache(1, 16)
        model(torch.tensor([[3, 9, 27, 81]]), cache, [4])  # a chunk of 4 rows: the GEMMs, no fused call
        return model(torch.tensor([[5]]), cache, [1])

    with torch.no_grad():
        fused = step()
        assert calls == ["qkv", "glu"] * model.config.num_layers
        monkeypatch.setattr(projection, "_fusable", lambda *a: False)
        apart = step()
    torch.testing.assert_close(fused.float(), apart.float(), atol=0.15, rtol=0.02)
    assert not torch.equal(fused, torch.zeros_like(fused))


@needs_bf16_rows
def test_fused_calls_compile_without_a_graph_break() -> None:
    """Traced through their Meta kernels (fullgraph) and run by the compiled code: the same values as eager (the
    ops' outputs returned as they are, so no fused arithmetic after them rounds differently)."""
    from static_decode.model import projection

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 1, 64, generator=gen).bfloat16()
    wq, wk, wv = (torch.randn(n, 64, generator=gen).bfloat16() for n in (48, 16, 16))

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = projection.qkv(torch.relu(x), wq, wk, wv)
        return q, k, v, projection.glu(torch.relu(x), wq, wq.flip(0))

    got, want = torch.compile(fn, fullgraph=True)(x), fn(x)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
