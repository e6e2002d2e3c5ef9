"""A batch-1 decode step's decoder layers as one call of our CPU kernel (csrc/decode_layers.cpp).

Why: the products already read the weights at the memory's rate; what is left is the dispatch and glue around each
layer's ~15 kernels, which one call removes (docs/internals.md#fused-decode). The cache is written in place at the
row's length and attention is the decode kernel's over the read bucket, each layer through its own sliding window
where it has one (the kernel then reads only the window's keys).

Where: capture.regions calls it in place of a compiled layer region for steps of one row and one slot, where
`unsupported` finds nothing against it; every other step (prefill chunks, batches, verify steps) and every other
model keeps the compiled region. The eager model never takes it: eager stays the reference it is tested against.
"""

from __future__ import annotations

import torch

from static_decode.core.attention import resolve_impl
from static_decode.core.cache import StaticKVCache
from static_decode.kernels import cpu_kernel
from static_decode.model.blocks import Block
from static_decode.model.gguf_dequant import BlockType
from static_decode.model.gguf_quant import BlockWeight, block_types
from static_decode.model.llama import Llama
from static_decode.model.quant import QuantWeight, Scheme

DTYPES = (torch.float32, torch.bfloat16)  # model dtypes the kernel takes (bfloat16: cpu_kernel.bf16_rows)


def unsupported(model: Llama, cache: StaticKVCache) -> str | None:
    """Why the fused layers cannot run one-token steps of `model` over `cache`, or None when they can (without
    building the kernels: `FusedLayers` does)."""
    c = model.config
    groups = c.num_heads // c.num_kv_heads
    reasons = (
        (model.device.type != "cpu", f"the model is on {model.device}, the kernel is the CPU's"),
        (model.tp.enabled, "a tensor-parallel model (its all-reduces stay in the step graph)"),
        (cache.batch != 1, f"batch {cache.batch}: the kernel reads the weights once for one row"),
        (model.dtype not in DTYPES, f"model dtype {model.dtype}"),
        (model.dtype == torch.bfloat16 and not cpu_kernel.bf16_rows(), "bfloat16 weights need AVX512-BF16 or AVX2"),
        (c.qkv_bias or c.o_bias or c.mlp_bias, "projection biases"),
        (c.qk_norm, "q/k norms (Qwen3)"),
        (c.attn_softcap is not None, "softcapped attention scores (Gemma 2): the kernel's softmax takes no cap"),
        (c.sandwich_norms or c.norm_plus_one, "Gemma's (1 + weight) norms, four a layer"),
        (c.hidden_act != "silu", f"MLP activation {c.hidden_act} (the kernel's is SwiGLU)"),
        (c.query_scale is not None, "a score scale other than head_dim ** -0.5 (query_pre_attn_scalar)"),
        (c.local_rope is not None, "a second rotary table for the sliding layers (Gemma 3)"),
        (c.rope.rotary_dim(c.head_dim) != c.head_dim, "partial rotary embedding (the kernel rotates whole heads)"),
        (not cpu_kernel.supports(groups, c.head_dim, cache.dtype, cache.device), f"head_dim {c.head_dim}"),
    )
    for bad, why in reasons:
        if bad:
            return why
    formats = {getattr(s, "name", "float") for s in projection_formats(model)}
    if kinds := block_types(model.layers):  # GGUF blocks of any types together: each product reads its own
        if formats - kinds:
            return f"projections both GGUF blocks and {', '.join(sorted(formats - kinds))}: the kernel takes one kind"
        if cache.dtype == torch.int8:
            return "an int8 cache with GGUF blocks (the int8-cache layers take float, int8 and int4 weights)"
    elif len(formats) > 1:
        return f"projections in several formats ({', '.join(sorted(formats))}): the kernel takes one"
    impl = resolve_impl(model.attn_impl, 1, cache.kv_heads, groups, cache.device, c.head_dim, cache.dtype)
    if impl != "decode_kernel":
        return f"attention {model.attn_impl!r} resolves to {impl!r}, not the decode kernel"
    return None


def projection_formats(model: Llama) -> set[Scheme | BlockType | None]:
    """The formats of the decoder layers' projections: their QuantWeights' schemes and BlockWeights' block types,
    None for float weights."""
    return {
        m.weight.scheme if isinstance(m.weight, (QuantWeight, BlockWeight)) else None
        for block in model.layers for part in (block.self_attn, block.mlp) for m in part.children()
        if isinstance(getattr(m, "weight", None), (QuantWeight, BlockWeight))
        or (isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2)
    }


def _rows(weight: torch.Tensor | QuantWeight | BlockWeight, sizes: list[int]
          ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """A weight's row blocks (contiguous views) as (weight, None), a quantized one's as (codes, scales), GGUF blocks'
    as (blocks, None): a quantized row's codes and scales are its own (per-row scales, groups along K)."""
    if isinstance(weight, QuantWeight):
        return list(zip(weight.qweight.split(sizes), weight.scales.split(sizes), strict=True))
    if isinstance(weight, BlockWeight):
        return [(w, None) for w in weight.blocks.split(sizes)]
    return [(w, None) for w in weight.split(sizes)]


def layer_types(block: Block) -> list[int]:
    """The GGUF type numbers of a block's seven projections in the kernel's order (q, k, v, o, gate, up, down: a
    joined weight's parts share its type), empty where they are not GGUF blocks."""
    a, m = block.self_attn, block.mlp
    qkv = [a.qkv_proj.weight] * 3 if a.fused else [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]
    gate_up = [m.gate_up_proj.weight] * 2 if m.fused else [m.gate_proj.weight, m.up_proj.weight]
    weights = [*qkv, a.o_proj.weight, *gate_up, m.down_proj.weight]
    return [w.scheme.number for w in weights] if isinstance(weights[0], BlockWeight) else []


def layer_weights(block: Block) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The nine tensors of a block in the kernel's order (csrc/decode_layers.cpp, kPerLayer), a quantized
    projection's codes in its weight's place, and the scales of the seven projections (empty for a float model);
    q/k/v and gate/up are row blocks (contiguous views) of the joined weights where the model joined them."""
    a, m = block.self_attn, block.mlp
    if a.fused:
        qkv = _rows(a.qkv_proj.weight, list(a.sizes))
    else:
        qkv = [_rows(p.weight, [p.weight.shape[0]])[0] for p in (a.q_proj, a.k_proj, a.v_proj)]
    if m.fused:
        gate_up = _rows(m.gate_up_proj.weight, [m.inner, m.inner])
    else:
        gate_up = [_rows(p.weight, [p.weight.shape[0]])[0] for p in (m.gate_proj, m.up_proj)]
    o, down = (_rows(p.weight, [p.weight.shape[0]])[0] for p in (a.o_proj, m.down_proj))
    (q, k, v), (gate, up) = qkv, gate_up
    weights = [
        block.input_layernorm.weight, q[0], k[0], v[0], o[0],
        block.post_attention_layernorm.weight, gate[0], up[0], down[0],
    ]
    scales = [s for _, s in (q, k, v, o, gate, up, down) if s is not None]
    return weights, scales


class FusedLayers:
    """Layers start..stop-1 of `model` as one kernel call for one-token, one-row steps.

    It holds the parameter tensors the blocks had when it was built (as a compiled region holds its graph): weights
    loaded in place (`load_state_dict` without `assign`) are seen; parameters replaced by new tensors are not, so
    build a new Generator after replacing them. Under torch.profiler each layer is a `static_decode::decode_layer`
    range inside the `decode_layers` op."""

    def __init__(self, model: Llama, start: int, stop: int) -> None:
        if not cpu_kernel.available():
            raise RuntimeError("the CPU kernels are not built (no compiler, or STATIC_DECODE_CPU_KERNEL=0)")
        self.model, self.start, self.stop = model, start, stop
        self.eps = float(model.config.rms_norm_eps)
        # The parameters themselves (not copies): a load_state_dict into the model is seen; contiguous already
        # (nn.Linear's), checked by the kernel on every call.
        self.weights: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] = []  # a quantized model's: 7 a layer (the kernel's kQuantIndex order)
        self.types: list[int] = []  # GGUF blocks' type numbers: 7 a layer, in the same order
        for block in model.layers[start:stop]:
            weights, scales = layer_weights(block)
            self.weights += [w.detach() for w in weights]
            self.scales += scales
            self.types += layer_types(block)
        schemes = {s for s in projection_formats(model) - {None} if isinstance(s, Scheme)}
        scheme = next(iter(schemes)) if len(schemes) == 1 else None  # one format (`unsupported` says why not)
        self.group = -1 if scheme is None else scheme.group  # -1: float; 0: int8; else the int4 group
        # Each layer's sliding window for the kernel (0: none); empty when no layer of the span slides.
        windows = [block.self_attn.window or 0 for block in model.layers[start:stop]]
        self.windows = windows if any(windows) else []

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lens: torch.Tensor,
        n_new: torch.Tensor,
        lens_after: torch.Tensor,
        read_len: int,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [1, 1, D] through the layers; k/v [n, 1, Hkv, max_len + spare, d] the span's cache layers (written in
        place at lens, the old length); cos/sin [1, 1, 1, d/2]; `scales`: an int8 cache's (k_scale, v_scale)
        [n, 1, Hkv, max_len + spare] float32 (k/v then its codes), written in place with them. Returns x after the
        last layer."""
        if scales is not None:
            return torch.ops.static_decode_cpu.decode_layers_kv8(
                x.contiguous(), cos.contiguous(), sin.contiguous(), k, v, scales[0], scales[1], lens, n_new,
                lens_after, int(read_len), self.weights, self.scales, self.group, self.eps, self.windows,
            )  # [1, 1, D]
        if self.types:
            return torch.ops.static_decode_cpu.decode_layers_gguf(
                x.contiguous(), cos.contiguous(), sin.contiguous(), k, v, lens, n_new, lens_after, int(read_len),
                self.weights, self.types, self.eps, self.windows,
            )  # [1, 1, D]
        if self.group >= 0:
            return torch.ops.static_decode_cpu.decode_layers_q(
                x.contiguous(), cos.contiguous(), sin.contiguous(), k, v, lens, n_new, lens_after, int(read_len),
                self.weights, self.scales, self.group, self.eps, self.windows,
            )  # [1, 1, D]
        return torch.ops.static_decode_cpu.decode_layers(
            x.contiguous(), cos.contiguous(), sin.contiguous(), k, v, lens, n_new, lens_after, int(read_len),
            self.weights, self.eps, self.windows,
        )  # [1, 1, D]
