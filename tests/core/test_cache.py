"""StaticKVCache: written once in place, never moved (rule 1), never repeated (rule 2), refused before writing (rule 6).

Pins: growth by torch.cat (copies the whole cache every step), KV repeat for GQA (G x the bytes), a buffer
that is reallocated, and a failed append that leaves half-written K/V or advanced lengths behind. The no-copy
checks cover every attention impl, the default `sdpa_folded` included (its one copy is the boolean mask folded
over the group, never K or V), and a whole model step, where K/V storage is only written in place and read
through views by the attention kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from static_decode import Llama, LlamaConfig, StaticKVCache, gqa_attention
from static_decode.core.attention import DEFAULT_IMPL, IMPLS

# "flex" is for compiled CUDA steps only (static_decode/core/attention.py): PyTorch's eager flex_attention is its
# unfused reference, which repeats K/V for GQA, so the no-copy checks of eager runs cover the other impls.
EAGER_IMPLS = tuple(i for i in IMPLS if i != "flex")


def _raise(*_a, **_k):
    raise AssertionError("forbidden op on the cache path")


@pytest.fixture
def no_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch.cat/concat/concatenate, repeat_interleave and Tensor.repeat raise."""
    for name in ("cat", "concat", "concatenate", "repeat_interleave"):
        monkeypatch.setattr(torch, name, _raise)
    monkeypatch.setattr(torch.Tensor, "repeat", _raise)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", _raise)


@pytest.mark.parametrize("impl", EAGER_IMPLS)
def test_no_concat_no_repeat_and_storage_never_moves(no_copies: None, impl: str) -> None:
    with pytest.raises(AssertionError):
        torch.cat([torch.zeros(1)])  # the patch is live
    cache = StaticKVCache(2, 2, 64, 8, dtype=torch.float32)
    ptrs = (cache.k.data_ptr(), cache.v.data_ptr(), cache.lens.data_ptr())
    rng = np.random.default_rng(0)
    for _ in range(20):
        T = int(rng.integers(1, 6))
        n = rng.integers(0, T + 1, size=2)
        cache.append(torch.randn(2, 2, T, 8), torch.randn(2, 2, T, 8), n)
        out = gqa_attention(torch.randn(2, 8, T, 8), cache, n, impl=impl)
        assert out.shape == (2, 8, T, 8)
        assert (cache.k.data_ptr(), cache.v.data_ptr(), cache.lens.data_ptr()) == ptrs
    cache.reset()
    assert (cache.k.data_ptr(), cache.v.data_ptr(), cache.lens.data_ptr()) == ptrs


def test_append_writes_exactly_the_real_slots() -> None:
    cache = StaticKVCache(2, 1, 6, 2, dtype=torch.float64)
    k = torch.arange(2 * 1 * 3 * 2, dtype=torch.float64).view(2, 1, 3, 2) + 1
    cache.append(k, -k, [2, 3])
    cache.append(k[:, :, :1] * 10, k[:, :, :1] * 10, [1, 0])
    expected = torch.zeros(2, 1, 6, 2, dtype=torch.float64)
    expected[0, 0, :2] = k[0, 0, :2]
    expected[0, 0, 2] = k[0, 0, 0] * 10
    expected[1, 0, :3] = k[1, 0, :3]
    assert torch.equal(cache.k[0, :, :, :6], expected)  # nothing past each row's length was touched
    assert torch.equal(cache.v[0, :, :, :6, :][1], -expected[1])
    assert cache.lens.tolist() == [3, 3] and cache.host_lens.tolist() == [3, 3]
    assert cache.k.shape == (1, 2, 1, 7, 2)  # one spare position for padded slots


def test_fills_to_exactly_max_len() -> None:
    cache = StaticKVCache(1, 1, 5, 2)
    cache.append(torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2), [4])
    cache.append(torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2), [1])  # 3 padded slots past the end: fine
    assert cache.host_lens.tolist() == [5]


def _snapshot(cache: StaticKVCache):
    return cache.k.clone(), cache.v.clone(), cache.lens.clone(), cache.host_lens.copy()


def _assert_same(cache: StaticKVCache, snap) -> None:
    k, v, lens, host = snap
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)
    assert torch.equal(cache.lens, lens) and np.array_equal(cache.host_lens, host)


B, H, D, MAX = 2, 2, 4, 10


def _kv(T: int = 3, **kw):
    shape = kw.pop("shape", (B, H, T, D))
    return torch.randn(shape, **kw), torch.randn(shape, **kw)


BAD_APPENDS = {
    "overflow": (lambda: (*_kv(4), [4, 1]), ValueError, r"row 0 would overflow: it holds 7 .* 11 > max_len=10"),
    "rank": (lambda: (*_kv(shape=(B, H, 3)), [1, 1]), ValueError, "rank 3"),
    "batch": (lambda: (*_kv(shape=(3, H, 3, D)), [1, 1]), ValueError, r"\[B=2"),
    "heads": (lambda: (*_kv(shape=(B, 3, 3, D)), [1, 1]), ValueError, "Hkv=2"),
    "head_dim": (lambda: (*_kv(shape=(B, H, 3, 5)), [1, 1]), ValueError, "d=4"),
    "dtype": (lambda: (*_kv(3, dtype=torch.float64), [1, 1]), TypeError, "float64"),
    "k_v_differ": (lambda: (torch.randn(B, H, 3, D), torch.randn(B, H, 2, D), [1, 1]), ValueError, "differ"),
    "negative": (lambda: (*_kv(3), [1, -1]), ValueError, r"n_new\[1\]=-1"),
    "above_T": (lambda: (*_kv(3), [4, 0]), ValueError, r"n_new\[0\]=4 must lie in 0..3"),
    "wrong_length": (lambda: (*_kv(3), [1, 1, 1]), ValueError, "3 entries"),
    "float_n": (lambda: (*_kv(3), [1.0, 1.0]), TypeError, "integers"),
    "2d_n": (lambda: (*_kv(3), [[1, 1]]), ValueError, "one-dimensional"),
    "not_tensor": (lambda: (np.zeros((B, H, 3, D), np.float32), torch.randn(B, H, 3, D), [1, 1]), TypeError, "Tensor"),
}


@pytest.mark.parametrize("case", sorted(BAD_APPENDS))
def test_bad_append_raises_and_leaves_cache_bit_identical(case: str) -> None:
    cache = StaticKVCache(B, H, MAX, D)
    cache.append(torch.randn(B, H, 7, D), torch.randn(B, H, 7, D), [7, 2])
    snap = _snapshot(cache)
    make, exc, match = BAD_APPENDS[case]
    with pytest.raises(exc, match=match):
        cache.append(*make())
    _assert_same(cache, snap)
    cache.append(*_kv(3), [3, 3])  # and the cache still works
    assert cache.host_lens.tolist() == [10, 5]


def test_device_mismatch_is_refused() -> None:
    cache = StaticKVCache(1, 1, 4, 2, device="meta")
    with pytest.raises(ValueError, match="is on cpu, the cache is on meta"):
        cache.append(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), [1])
    with pytest.raises(ValueError, match="is on cpu, the cache is on meta"):
        gqa_attention(torch.zeros(1, 2, 1, 2), cache, [0])


BAD_ATTENTION = {
    "rank": (lambda: torch.randn(B, 4, D), [1, 1], {}, ValueError, "rank-4"),
    "batch": (lambda: torch.randn(3, 4, 1, D), [1, 1], {}, ValueError, "batch 2"),
    "head_dim": (lambda: torch.randn(B, 4, 1, 8), [1, 1], {}, ValueError, "head_dim 4"),
    "not_multiple": (lambda: torch.randn(B, 3, 1, D), [1, 1], {}, ValueError, "Hq=3 .* Hkv=2"),
    "dtype": (lambda: torch.randn(B, 4, 1, D, dtype=torch.float64), [1, 1], {}, TypeError, "float64"),
    "n_above_T": (lambda: torch.randn(B, 4, 1, D), [2, 1], {}, ValueError, r"n_new\[0\]=2"),
    "n_above_len": (lambda: torch.randn(B, 4, 8, D), [7, 3], {}, ValueError, r"n_new\[1\]=3 .* row length 2"),
    "n_negative": (lambda: torch.randn(B, 4, 1, D), [0, -1], {}, ValueError, r"n_new\[1\]=-1"),
    "n_length": (lambda: torch.randn(B, 4, 1, D), [1], {}, ValueError, "1 entries"),
    "layer": (lambda: torch.randn(B, 4, 1, D), [1, 1], {"layer": 1}, ValueError, "layer=1"),
    "read_len_type": (lambda: torch.randn(B, 4, 1, D), [1, 1], {"read_len": 7.0}, TypeError, "read_len"),
}


@pytest.mark.parametrize("case", sorted(BAD_ATTENTION))
def test_bad_attention_raises_and_leaves_cache_bit_identical(case: str) -> None:
    cache = StaticKVCache(B, H, MAX, D)
    cache.append(torch.randn(B, H, 7, D), torch.randn(B, H, 7, D), [7, 2])
    snap = _snapshot(cache)
    make_q, n, kw, exc, match = BAD_ATTENTION[case]
    with pytest.raises(exc, match=match):
        gqa_attention(make_q(), cache, n, **kw)
    _assert_same(cache, snap)


@pytest.mark.parametrize(
    ("args", "exc"),
    [((0, 1, 1, 1), None), ((1, 0, 1, 1), ValueError), ((1, 1, 0, 1), ValueError), ((1, 1, 1, 0), ValueError),
     ((1.5, 1, 1, 1), TypeError), ((-1, 1, 1, 1), ValueError)],
)
def test_constructor_validation(args, exc) -> None:
    if exc is None:
        assert StaticKVCache(*args).batch == 0
    else:
        with pytest.raises(exc):
            StaticKVCache(*args)
    with pytest.raises(TypeError, match="dtype"):
        StaticKVCache(1, 1, 1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="single-layer"):
        StaticKVCache(1, 1, 4, 1, layers=2).append(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1), [1])


def test_multi_layer_step_api() -> None:
    """The model's per-step protocol: write every layer at the old lengths, attend with lens + n_new, advance once."""
    cache = StaticKVCache(2, 1, 8, 2, layers=3, dtype=torch.float64)
    n = cache.validate([2, 1], 2)
    n_dev = cache.device_ints(n)
    for layer in range(3):
        cache.write(layer, torch.full((2, 1, 2, 2), float(layer + 1), dtype=torch.float64),
                    torch.zeros(2, 1, 2, 2, dtype=torch.float64), n_dev)
    cache.advance(n_dev)
    cache.commit(n)
    assert cache.lens.tolist() == [2, 1] and cache.host_lens.tolist() == [2, 1]
    for layer in range(3):
        k, _ = cache.layer_view(layer, cache.longest())
        assert k.shape == (2, 1, 2, 2)
        assert (k[0] == layer + 1).all() and (k[1, :, 0] == layer + 1).all() and (k[1, :, 1] == 0).all()


FORBIDDEN_ATEN = ("cat", "repeat", "repeat_interleave", "clone", "_to_copy", "copy_", "contiguous", "index_select")


def _tensors(args, kwargs) -> list[torch.Tensor]:
    import torch.utils._pytree as pytree

    return [t for t in pytree.tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]


def _storages(*ts: torch.Tensor) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in ts}


@pytest.mark.parametrize("impl", EAGER_IMPLS)
def test_no_copy_at_the_aten_level(impl: str) -> None:
    """Stronger than patching Python names: no aten op that concatenates, repeats or copies runs on K or V,
    so neither is materialised again (a broadcasting matmul over G would show up here as a copy).

    Every impl but the default and split_key runs no such op at all. The default, sdpa_folded, folds the group
    into the query axis, so its [B, T, S] mask is expanded over G and reshaped to [B, 1, G*T, S]: for a chunk
    (T > 1) that reshape copies the boolean mask (B*G*T*S bools). That is the one copy it makes; K and V never."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cache = StaticKVCache(2, 2, 64, 16)  # head_dim 16: decode_kernel takes both steps
    kv = _storages(cache.k, cache.v)
    seen: list[str] = []
    copies: list[tuple[str, torch.dtype, tuple[int, ...], bool]] = []  # forbidden ops: (name, dtype, shape, on K/V)

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            seen.append(name)
            if name in FORBIDDEN_ATEN:
                for t in _tensors(args, kwargs):
                    copies.append((name, t.dtype, tuple(t.shape), bool(_storages(t) & kv)))
            return func(*args, **(kwargs or {}))

    with Spy():
        cache.append(torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16), [5, 3])
        gqa_attention(torch.randn(2, 8, 5, 16), cache, [5, 3], impl=impl)  # a chunk: T = 5
        cache.append(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16), [1, 1])
        gqa_attention(torch.randn(2, 8, 1, 16), cache, [1, 1], impl=impl, read_len=32)  # decode: T = 1
    assert seen
    assert not [c for c in copies if c[3]], copies  # nothing copies, repeats or concatenates K or V
    if impl == "sdpa_folded":
        assert copies == [("clone", torch.bool, (2, 1, 4, 5, 5), False)], copies  # the chunk's mask over G = 4
    elif impl == "split_key":
        # The folded mask as sdpa_folded, then per call at batch 2 the bias laid out per (row x KV head, block)
        # and the blocks' liveness: masks of G*T*S elements per KV head at most, never K/V (2*S*d per KV head).
        assert copies == [
            ("clone", torch.bool, (2, 1, 4, 5, 5), False), ("clone", torch.float32, (2, 2, 1, 20, 5), False),
            ("clone", torch.bool, (2, 2, 1, 4, 5), False), ("clone", torch.float32, (2, 2, 1, 4, 32), False),
            ("clone", torch.bool, (2, 2, 1, 4, 1), False),
        ], copies
    else:
        assert copies == [], copies


# What may touch the K/V storage in a model step: the in-place write, views, and the attention's readers.
KV_WRITES = {"index_put_"}
KV_VIEWS = {"select", "slice", "view", "_unsafe_view", "as_strided", "expand", "transpose", "t", "permute",
            "unsqueeze", "squeeze", "alias"}
KV_READERS = {"bmm", "mm", "decode_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "_flash_attention_forward", "_efficient_attention_forward"}
_DEVICE_CASES = [(impl, "cpu") for impl in EAGER_IMPLS] + [
    pytest.param(DEFAULT_IMPL, "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("impl", "device"), _DEVICE_CASES)
def test_model_step_writes_kv_in_place_and_reads_it_through_views(impl: str, device: str, dtype) -> None:
    """A whole model step (a prefill chunk, then a decode step) over a multi-layer cache: every aten op that
    touches the K/V storage is the in-place write, a view, or the attention's reader (the SDPA kernel, or the
    GEMMs of the matmul impls), and no view of K/V broadcasts it (an `expand` that grows it would be a repeat
    over G waiting to happen). So no step copies, repeats, casts or rescales K or V, whatever the impl."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    model = Llama(cfg, dtype=dtype, device=device, attn_impl=impl)
    cache = model.new_cache(2, 32)
    kv = _storages(cache.k, cache.v)
    touched: set[str] = set()
    broadcasts: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            ins = [t for t in _tensors(args, kwargs) if _storages(t) & kv]
            out = func(*args, **(kwargs or {}))
            if ins:
                touched.add(name)
                if name == "expand" and out.numel() > ins[0].numel():
                    broadcasts.append((tuple(ins[0].shape), tuple(out.shape)))
            return out

    n = torch.tensor([5, 3], device=device)
    with torch.no_grad(), Spy():
        model.hidden_states(torch.randint(0, 96, (2, 5), device=device), cache, n, 8)  # a chunk
        model.step(torch.randint(0, 96, (2, 1), device=device), cache, torch.ones_like(n), 16)  # decode
    assert touched & KV_WRITES and touched & KV_READERS, touched  # the spy saw the write and the read
    assert touched <= KV_WRITES | KV_VIEWS | KV_READERS, sorted(touched - (KV_WRITES | KV_VIEWS | KV_READERS))
    assert not broadcasts, broadcasts
    assert cache.lens.tolist() == [6, 4]  # both steps ran and advanced
