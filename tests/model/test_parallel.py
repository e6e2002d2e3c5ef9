"""Tensor parallelism over torch.distributed (gloo on the CPU): the shards add up to the single-process model.

Pins:
* 2 and 4 spawned ranks emit exactly the single-process Generator's greedy tokens (eager and compiled) and
  sampled tokens (same seed), every rank the same, and their chunked-prefill logits agree within float32
  tolerance (biases on, so a bias added on every rank instead of once would show);
* the compiled steps keep their all-reduces inside one graph per (kind, bucket): 2 per layer in every
  model step, none in `first_greedy` (the head is replicated), no graph break, no fallback;
* each rank's cache holds world-th of the KV heads and bytes, and its weights are the sharded ones;
* loading reads only the rank's slice of every split tensor (never the whole tensor) and the slices put back
  together are the checkpoint;
* a world size that does not divide the KV heads (or the MLP width) is refused with the reason, before any
  tensor is read; a rank outside the world is refused;
* a non-Llama family keeps a valid layout: Qwen3 (q/k/v/o biases, per-head q/k norms replicated on every rank,
  explicit head_dim) on 2 ranks gives the single process's tokens and logits, compiled with its all-reduces.
"""

from __future__ import annotations

import pytest
import safetensors
import torch

import static_decode.checkpoints.loading as loading
from capture import CaptureReport
from capture._dynamo_counters import has_dynamic_int
from static_decode import Generator, Llama, LlamaConfig, load_model
from static_decode.model.parallel import SINGLE, TensorParallel, shard_dim
from tests.support import tp_worker
from tests.support.checkpoints import hf_family, hf_llama, save

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4)
# Qwen3's switches on the same shape: every bias but the MLP's, q/k norms, head_dim not hidden_size // heads.
QWEN3 = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4,
                    head_dim=24, qkv_bias=True, o_bias=True, qk_norm=True, architecture="Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """8 query / 4 KV heads (worlds 1, 2, 4 keep whole GQA groups), biases on every projection."""
    return save(hf_llama(seed=7, kv_heads=4, bias=True), tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def reference(ckpt):
    return tp_worker.single(ckpt)


def _same_as_single(ranks, ref, world, kv_heads=CFG.num_kv_heads):
    for r, got in enumerate(ranks):
        assert (got["rank"], got["world"]) == (r, world)
        assert got["eager"] == ref["eager"], f"rank {r} greedy tokens differ from the single process"
        # Every rank samples from the same (all-reduced) logits with the same counter-hash noise.
        assert got["sampled"] == ranks[0]["sampled"] == ref["sampled"], f"rank {r} sampled other tokens"
        # Without a seed each process's own random state would differ: rank 0's seed is broadcast instead.
        assert got["unseeded"] == ranks[0]["unseeded"], f"rank {r} sampled other tokens without a seed"
        for a, b in zip(got["logits"], ref["logits"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert got["cache_heads"] == kv_heads // world
        assert got["cache_bytes"] * world == ref["cache_bytes"]
    assert ref["logits"][0].abs().max() > 1.0  # logits spread over units: the tolerance is not met trivially


def test_two_ranks_compiled_keep_collectives_in_the_graph(ckpt, reference, tmp_path):
    ranks = tp_worker.spawn(2, ckpt, tmp_path, compile_mode="count")
    _same_as_single(ranks, reference, 2)
    for got in ranks:
        assert got["compiled"] == reference["eager"]
        kinds = [(r["kind"], r["read_len"]) for r in got["records"]]
        assert sorted(kinds) == sorted(
            [("prefill", 16), ("prefill", 32), ("first_greedy", 0), ("decode_greedy", 16), ("decode_greedy", 32)]
        )
        assert all((r["graphs"], r["graph_breaks"], r["fallback"]) == (1, 0, "") for r in got["records"])
        # Per graph in compile order: each model step has one all-reduce after attention and one after the
        # MLP per layer; first_greedy runs only the replicated head.
        per_graph = dict(zip(kinds, got["all_reduces_per_graph"], strict=True))
        for (kind, _), n in per_graph.items():
            assert n == (0 if kind == "first_greedy" else 2 * CFG.num_layers), (kind, n)


def test_two_ranks_qwen3_compiled(tmp_path):
    """Qwen3 with attention_bias, 4 query / 2 KV heads: rank r holds KV head r, its 2 query heads, their slices
    of the q/k/v biases and the whole (replicated) q/k norm weights; o_proj's bias is added once, after the sum."""
    ckpt = save(hf_family("qwen3", seed=11, head_dim=24, attention_bias=True), tmp_path / "qwen3")
    ref = tp_worker.single(ckpt)
    ranks = tp_worker.spawn(2, ckpt, tmp_path, compile_mode="count")
    _same_as_single(ranks, ref, 2, kv_heads=2)
    for got in ranks:
        assert got["compiled"] == ref["eager"]
        assert all((r["graph_breaks"], r["fallback"]) == (0, "") for r in got["records"])
        kinds = [r["kind"] for r in got["records"]]
        for kind, n in zip(kinds, got["all_reduces_per_graph"], strict=True):
            assert n == (0 if kind == "first_greedy" else 2 * QWEN3.num_layers), (kind, n)


def test_four_ranks_eager(ckpt, reference, tmp_path):
    _same_as_single(tp_worker.spawn(4, ckpt, tmp_path), reference, 4)


@pytest.mark.slow
def test_two_ranks_inductor(ckpt, reference, tmp_path):
    """The CPU default compile (inductor, C++ wrapper, a symbolic read length) with the collectives inside the
    generated code: one graph per kind over both rungs (the second rung's record shows 0 graphs)."""
    for got in tp_worker.spawn(2, ckpt, tmp_path, compile_mode="inductor"):
        assert got["compiled"] == reference["eager"]
        assert all((r["graph_breaks"], r["fallback"]) == (0, "") for r in got["records"])
        per_kind = CaptureReport.from_json({"records": got["records"]}).graphs_per_kind()
        assert per_kind == {"prefill": (1, 2), "first_greedy": (1, 1), "decode_greedy": (1, 2)} or (
            not has_dynamic_int() and all(g <= 2 for g, _ in per_kind.values())), per_kind


# ---- no processes: layout, loading, refusals -------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [CFG, QWEN3], ids=["llama", "qwen3"])
def test_every_parameter_has_its_layout(cfg):
    full = dict(Llama(cfg, device="meta").named_parameters())
    for world in (2, 4):
        for name, p in Llama(cfg, device="meta", tp=TensorParallel(rank=world - 1, world=world)).named_parameters():
            dim = shard_dim(name)
            want = list(full[name].shape)
            if dim is not None:
                want[dim] //= world
            assert list(p.shape) == want, name
    if cfg.qk_norm:  # one [head_dim] weight for every head: whole on every rank, whatever heads it owns
        assert full["layers.0.self_attn.q_norm.weight"].shape == (cfg.head_dim,)
        for name in ("q_norm.weight", "k_norm.weight", "o_proj.bias"):
            assert shard_dim(f"layers.0.self_attn.{name}") is None, name  # replicated
        assert shard_dim("layers.0.self_attn.q_proj.bias") == 0  # split with its query heads
        return
    split = {n for n in full if shard_dim(n) is not None}
    assert {n.split(".", 2)[2] for n in split} == {
        "self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
    }  # fmt: skip
    # The checkpoint's names (what loading slices): the parts the joined weights stack.
    unfused = dict(Llama(cfg, device="meta", fused_projections=False).named_parameters())
    assert {n.split(".", 2)[2] for n in unfused if shard_dim(n) is not None} == {
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    }  # fmt: skip
    assert shard_dim("layers.0.self_attn.o_proj.bias") is None  # added once, after the all-reduce


def _recording_safe_open(monkeypatch):
    """Patch loading's safe_open to record (key, elements) of every tensor read and how it was read."""
    reads: list[tuple[str, str, int]] = []

    class Slice:
        def __init__(self, inner, key):
            self.inner, self.key = inner, key

        def __getitem__(self, index):
            t = self.inner[index]
            reads.append((self.key, "slice", t.numel()))
            return t

        def __getattr__(self, name):
            return getattr(self.inner, name)

    class Recording:
        def __init__(self, *a, **kw):
            self.f = safetensors.safe_open(*a, **kw)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, key):
            t = self.inner.get_tensor(key)
            reads.append((key, "whole", t.numel()))
            return t

        def get_slice(self, key):
            return Slice(self.inner.get_slice(key), key)

        def keys(self):
            return self.inner.keys()

    monkeypatch.setattr(loading, "safe_open", Recording)
    return reads


def test_loading_reads_only_the_rank_slice(ckpt, monkeypatch):
    # state_dict(): the checkpoint's names (q/k/v and gate/up as row blocks of the joined weights)
    full = load_model(ckpt).state_dict()
    reads = _recording_safe_open(monkeypatch)
    shards = []
    for rank in range(2):
        reads.clear()
        model = load_model(ckpt, tp=TensorParallel(rank=rank, world=2))
        shards.append(model.state_dict())
        data = [(k, how, n) for k, how, n in reads if n > 0 and how in ("whole", "slice")]
        for key, how, n in data:
            name = key.removeprefix("model.")
            if shard_dim(name) is not None:
                assert how == "slice" and n * 2 == full[name].numel(), (key, how, n)
        assert sum(n for _, _, n in data) == sum(p.numel() for p in model.parameters())
    for name, p in full.items():  # the slices, put back in rank order, are the checkpoint
        dim = shard_dim(name)
        parts = [s[name] for s in shards]
        if dim is None:
            assert all(torch.equal(x, p) for x in parts), name
        else:
            assert torch.equal(torch.cat(parts, dim=dim), p), name


def test_world_not_dividing_kv_heads_is_refused_before_reading(ckpt, monkeypatch):
    with pytest.raises(ValueError, match=r"world size 3 does not divide num_kv_heads=4.*among \[1, 2, 4\]"):
        Llama(CFG, device="meta", tp=TensorParallel(rank=0, world=3))
    reads = _recording_safe_open(monkeypatch)
    with pytest.raises(ValueError, match="world size 8 does not divide num_kv_heads=4"):
        load_model(ckpt, tp=TensorParallel(rank=0, world=8))
    assert reads == []
    mlp = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=90, num_layers=1, num_heads=8, num_kv_heads=4)
    with pytest.raises(ValueError, match="does not divide intermediate_size=90"):
        Llama(mlp, device="meta", tp=TensorParallel(rank=0, world=4))


@pytest.mark.parametrize(
    "rank, world, error", [(2, 2, ValueError), (-1, 2, ValueError), (0, 0, ValueError), (0, 2.0, TypeError)]
)
def test_bad_rank_or_world_is_refused(rank, world, error):
    with pytest.raises(error, match="tensor-parallel"):
        TensorParallel(rank=rank, world=world)


def test_a_shard_without_its_process_group_is_refused():
    model = Llama(CFG, tp=TensorParallel(rank=1, world=2))
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match=r"shard of tensor-parallel rank 1 of 2, but .*torchrun"):
        Generator(model, max_len=16)
    cache = model.new_cache(1, 16)
    with pytest.raises(RuntimeError, match="not initialised"):
        model(torch.zeros(1, 2, dtype=torch.int64), cache, [2])
    assert cache.host_lens.tolist() == [0] and cache.lens.tolist() == [0]


def test_single_process_is_unchanged():
    assert not SINGLE.enabled and SINGLE.backend() is None
    x = torch.randn(3)
    assert SINGLE.all_reduce(x) is x  # no collective, no copy at world 1
    assert Llama(CFG, device="meta").kv_heads == CFG.num_kv_heads
