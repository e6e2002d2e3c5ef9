"""Joined projections (static_decode.model.joining): q/k/v as one matmul, gate/up as one.

Pins:
* the joined model's logits equal the unfused model's with the same weights (eager, prefill chunks and decode
  steps over ragged rows; float32 within 1e-5, a bfloat16 decode row through the CPU GEMV kernel bit-identical);
* the state dict keeps the checkpoint's names both ways: `state_dict()` gives q/k/v and gate/up as row-block views
  of the joined weight (no copy), `load_state_dict` takes them (from either layout) and joins them;
* loading joins once: one [(Hq + 2 Hkv) d, D] weight per layer, biases joined with it (Qwen2-style q/k/v biases,
  MLP biases), the same logits as the unfused load;
* under tensor parallelism each rank's joined weight is its own q, k, v slices stacked (and gate, up), which is not
  a slice of the whole joined matrix;
* the fused decode layers get contiguous row-block views of the joined weights (no copy), in the kernel's order.
"""

from __future__ import annotations

import pytest
import torch

from static_decode import Llama, LlamaConfig, load_model
from static_decode.kernels import cpu_kernel
from static_decode.model import fused_decode
from static_decode.model.parallel import TensorParallel
from tests.support.checkpoints import feed, hf_family, hf_llama, prompt, save

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=2)
BIASED = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=2,
                     qkv_bias=True, mlp_bias=True, o_bias=True)


def pair(cfg: LlamaConfig, dtype: torch.dtype = torch.float32) -> tuple[Llama, Llama]:
    """(unfused, fused) models with the same random weights (biases and norms random too)."""
    torch.manual_seed(0)
    unfused = Llama(cfg, dtype=dtype, fused_projections=False).requires_grad_(False)
    with torch.no_grad():
        for p in unfused.parameters():
            p.normal_(0.0, 0.3)
    fused = Llama(cfg, dtype=dtype).requires_grad_(False)
    fused.load_state_dict(unfused.state_dict(), strict=True)
    return unfused, fused


@pytest.mark.parametrize("cfg", [CFG, BIASED], ids=["plain", "biased"])
def test_logits_equal_unfused(cfg):
    unfused, fused = pair(cfg)
    rows = [prompt(21, seed=1), prompt(9, seed=2)]
    for chunk in (1, 4):  # decode steps (one slot per row) and prefill chunks with padded slots
        want, got = feed(unfused, rows, chunk), feed(fused, rows, chunk)
        assert len(want) == len(got) > 1
        for a, b in zip(want, got, strict=True):
            assert a.std() > 0.5  # not trivially small
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernel.gemv_ready(torch.zeros(8, 8, dtype=torch.bfloat16)),
                    reason="no bfloat16 GEMV kernel here")
def test_bfloat16_decode_row_bit_identical():
    # One row, bfloat16: both layouts run our GEMV kernel (one call over the joined weight, or the three-weight
    # call): every output element is one weight row's dot product, accumulated the same way.
    unfused, fused = pair(CFG, torch.bfloat16)
    for a, b in zip(feed(unfused, [prompt(12)], 1), feed(fused, [prompt(12)], 1), strict=True):
        assert torch.equal(a, b)


def test_state_dict_speaks_the_checkpoint_layout():
    unfused, fused = pair(BIASED)
    a, b = unfused.state_dict(), fused.state_dict()
    assert list(sorted(a)) == list(sorted(b))  # same names: q_proj/k_proj/v_proj, gate_proj/up_proj
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # Views of the joined weight, not copies.
    attn = fused.layers[0].self_attn
    joined = attn.qkv_proj.weight
    q = b["layers.0.self_attn.q_proj.weight"]
    assert q.data_ptr() == joined.data_ptr() and q.shape == (8 * 8, 64)
    assert b["layers.0.self_attn.v_proj.weight"].data_ptr() == joined[64 + 16:].data_ptr()
    names = {n for n, _ in fused.named_parameters()}
    assert "layers.0.self_attn.qkv_proj.weight" in names and "layers.0.mlp.gate_up_proj.weight" in names
    assert not any(n.endswith(("q_proj.weight", ".gate_proj.weight")) for n in names)
    # The same number of weights either way.
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in unfused.parameters())
    # And back: an unfused model loads a fused model's state dict (in place).
    again = Llama(BIASED, fused_projections=False)
    again.load_state_dict(fused.state_dict(), strict=True)
    assert all(torch.equal(again.state_dict()[k], a[k]) for k in a)


def test_joined_rows_are_the_parts_in_order():
    unfused, fused = pair(BIASED)
    u, f = unfused.layers[1], fused.layers[1]
    want = torch.cat([u.self_attn.q_proj.weight, u.self_attn.k_proj.weight, u.self_attn.v_proj.weight])
    assert torch.equal(f.self_attn.qkv_proj.weight, want)
    assert torch.equal(f.self_attn.qkv_proj.bias, torch.cat([u.self_attn.q_proj.bias, u.self_attn.k_proj.bias,
                                                             u.self_attn.v_proj.bias]))
    assert torch.equal(f.mlp.gate_up_proj.weight, torch.cat([u.mlp.gate_proj.weight, u.mlp.up_proj.weight]))
    assert torch.equal(f.mlp.gate_up_proj.bias, torch.cat([u.mlp.gate_proj.bias, u.mlp.up_proj.bias]))
    for got, ref in zip(f.self_attn.qkv_weights() + f.mlp.glu_weights(),
                        u.self_attn.qkv_weights() + u.mlp.glu_weights(), strict=True):
        assert torch.equal(got, ref)


def test_missing_part_is_named():
    _, fused = pair(CFG)
    state = fused.state_dict()
    del state["layers.1.self_attn.k_proj.weight"]
    with pytest.raises(RuntimeError, match="k_proj.weight"):
        Llama(CFG).load_state_dict(state, strict=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {
        "llama": save(hf_llama(seed=3, kv_heads=4, bias=True), tmp_path_factory.mktemp("fused_llama")),
        "qwen2": save(hf_family("qwen2", seed=4), tmp_path_factory.mktemp("fused_qwen2")),
    }


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_loading_joins_once_and_matches_unfused(ckpts, family):
    fused = load_model(ckpts[family])
    unfused = load_model(ckpts[family], fused_projections=False)
    c = fused.config
    attn = fused.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size)
    assert fused.layers[0].mlp.gate_up_proj.weight.shape == (2 * c.intermediate_size, c.hidden_size)
    rows = [prompt(17, seed=5), prompt(6, seed=6)]
    for a, b in zip(feed(unfused, rows, 5), feed(fused, rows, 5), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_rank_joins_its_own_slices(ckpts, world):
    full = load_model(ckpts["llama"], fused_projections=False)  # 8 query / 4 KV heads, biases
    c = full.config
    d = c.head_dim
    for rank in range(world):
        tp = TensorParallel(rank=rank, world=world)
        shard = load_model(ckpts["llama"], tp=tp)
        for u, f in zip(full.layers, shard.layers, strict=True):
            a, m = u.self_attn, u.mlp
            q0, q1 = tp.span(c.num_heads * d)
            k0, k1 = tp.span(c.num_kv_heads * d)
            i0, i1 = tp.span(c.intermediate_size)
            want = torch.cat([a.q_proj.weight[q0:q1], a.k_proj.weight[k0:k1], a.v_proj.weight[k0:k1]])
            assert torch.equal(f.self_attn.qkv_proj.weight, want)
            want_b = torch.cat([a.q_proj.bias[q0:q1], a.k_proj.bias[k0:k1], a.v_proj.bias[k0:k1]])
            assert torch.equal(f.self_attn.qkv_proj.bias, want_b)
            want_gu = torch.cat([m.gate_proj.weight[i0:i1], m.up_proj.weight[i0:i1]])
            assert torch.equal(f.mlp.gate_up_proj.weight, want_gu)
            # Not the rank's slice of the whole joined matrix (which would hold only query rows for rank 0).
            whole = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            lo, hi = tp.span(whole.shape[0])
            assert not torch.equal(f.self_attn.qkv_proj.weight, whole[lo:hi])
            # Its heads: q rows of its query heads, then its KV heads' k and v rows.
            assert f.self_attn.sizes == (c.num_heads // world * d, c.num_kv_heads // world * d,
                                         c.num_kv_heads // world * d)


def test_fused_decode_gets_row_block_views():
    _, fused = pair(CFG)
    block = fused.layers[0]
    ws, scales = fused_decode.layer_weights(block)
    assert scales == []  # a float model's
    joined, gate_up = block.self_attn.qkv_proj.weight, block.mlp.gate_up_proj.weight
    q, k, v, gate, up = ws[1], ws[2], ws[3], ws[6], ws[7]
    assert [t.shape[0] for t in (q, k, v)] == [64, 16, 16] and gate.shape[0] == up.shape[0] == 128
    assert all(t.is_contiguous() for t in ws)
    assert q.data_ptr() == joined.data_ptr() and k.data_ptr() == joined[64:].data_ptr()
    assert v.data_ptr() == joined[80:].data_ptr()
    assert gate.data_ptr() == gate_up.data_ptr() and up.data_ptr() == gate_up[128:].data_ptr()
