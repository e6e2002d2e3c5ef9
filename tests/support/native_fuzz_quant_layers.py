"""`decode_layers_q`'s share of the worker's "quant" family (tests/support/native_fuzz_quant.py has gemv_q's and the
formats both use): csrc/decode_layers.cpp over quantized projections.

Small quantized models (int8 and int4 at each group; float32 and bfloat16; q/k/v and gate/up joined or apart; one or
two layers) with their codes and scales as FusedLayers passes them (`fused_decode.layer_weights`), over a cache with
guard rows (the worker's `guarded`), with one or two things broken or none: the scales' count, one scale's shape,
dtype or strides, the group, a float weight or codes of another dtype, shape or strides where a projection's codes
belong, a norm, the weights' count, x, the cache, the lengths. A valid call equals the eager quantized layers
(`run_blocks` over a copy of the cache, "matmul" attention over a float32 cache) within a tolerance, writes only
its slot's row, and equals FusedLayers' call bit for bit; a refused one raises from the op's checks. Validity is
decided from the tensors passed (`layers_q_valid`); every tensor a call is given is compared bit for bit
afterwards (only the slot's cache row may change, and only when the call ran).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
from hypothesis import find, given
from hypothesis import strategies as st

from static_decode import Llama, LlamaConfig
from static_decode.core.cache import LayerSpan
from static_decode.kernels import cpu_kernel
from static_decode.model import quant, rope
from static_decode.model.blocks import run_blocks, step_attention
from static_decode.model.fused_decode import FusedLayers, layer_weights
from tests.support.native_fuzz_quant import (
    BAD_GROUPS,
    FIRST,
    GROUPS,
    OPS,
    Harness,
    breaks,
    dequantized,
    drawn,
    quant_shape,
    refused_by_check,
)

# K of every projection a multiple of 128: each int4 group takes every projection.
CONFIGS = {
    "joined": (LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=32), True),
    "apart": (LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=64), False),
}
SCHEMES = ("int8", "int4-g32", "int4-g64", "int4-g128")
PROJECTIONS = (1, 2, 3, 4, 6, 7, 8)  # the kernel's weight index of each of a layer's 7 scales (kQuantIndex)
# What a decode_layers_q case can get wrong, and in how many forms (its `variant`).
LAYER_BREAKS = {"scale_count": 2, "scale_shape": 4, "scale_dtype": 4, "scale_layout": 1, "group": 1,
                "float_weight": 1, "codes_dtype": 4, "codes_shape": 4, "codes_layout": 1, "norm": 4,
                "weight_count": 2, "x": 4, "n": 3, "lens": 3, "after": 2, "read_len": 3, "kv_dtype": 1, "layout": 1}


@functools.cache
def quantized_model(dtype: torch.dtype, scheme: str, config: str) -> Llama:
    """A small random model quantized with `scheme` (built once per process: quantizing is the slow part)."""
    cfg, joined = CONFIGS[config]
    model = Llama(cfg, dtype=dtype, fused_projections=joined)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)  # large enough that every layer moves x
    return quant.quantize_model(model, scheme).eval()


@st.composite
def layers_q_case(draw, h: Harness, forced: tuple[str, int, str] | None = None) -> dict:
    """A decode_layers_q case; `forced`: (break, form, scheme) instead of drawn ones (a length's forms: the values
    listed here; break "none": a valid case of that scheme)."""
    bad = {forced[0]} - {"none"} if forced else breaks(draw, list(LAYER_BREAKS))

    def value(name: str, forms: list[int], drawn: st.SearchStrategy[int]) -> int:
        return forms[forced[1]] if forced and forced[0] == name else draw(drawn)

    config = draw(st.sampled_from(sorted(CONFIGS)))
    max_len = draw(st.integers(1, 10))
    n = value("n", [2, -1, 10**9], h.length if "n" in bad else st.integers(0, 1))
    lens = value("lens", [-1, max_len - n + 1, 10**9], h.length if "lens" in bad or n not in (0, 1) and not forced
                 else st.integers(0, max(max_len - max(n, 0), 0)))  # forced: the other lengths fit the cache
    floor = max(1, lens + n) if -(10**6) < lens + n <= max_len else 1
    return dict(
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        scheme=forced[2] if forced else draw(st.sampled_from(SCHEMES)), config=config, bad=sorted(bad),
        max_len=max_len, n=n, lens=lens,
        after_delta=value("after", [1, -1], st.sampled_from([1, -1, 10**9]) if "after" in bad else st.just(0)),
        read_len=value("read_len", [0, max_len + 1, 2**40], st.one_of(
            st.sampled_from([0, -1, max_len + 1]), st.integers(-1, 12), h.length) if "read_len" in bad else
            st.integers(min(floor, max_len), max_len)),
        kv_dtype=torch.float64 if "kv_dtype" in bad else draw(st.sampled_from(
            [None, None, torch.float32, torch.bfloat16, torch.float16])),
        layout=draw(st.sampled_from(["transposed"] if "layout" in bad else ["dense", "dense", "padded"])),
        layer=draw(st.integers(0, CONFIGS[config][0].num_layers - 1)), projection=draw(st.integers(0, 6)),
        group=draw(st.sampled_from([*GROUPS, *BAD_GROUPS])),
        variant=forced[1] if forced else draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**16)),
    )


def layers_q_tensors(c: dict, model: Llama) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """(weights, scales, group) as FusedLayers passes them for `model`, then the case's weight and scale breaks."""
    weights: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    for block in model.layers:
        w, s = layer_weights(block)
        weights += [t.detach() for t in w]
        scales += list(s)
    group, bad, var = quant.parse(c["scheme"]).group, c["bad"], c["variant"]
    si = c["layer"] * 7 + c["projection"]  # the scale, and the codes they go with
    wi = c["layer"] * 9 + PROJECTIONS[c["projection"]]
    q, s = weights[wi], scales[si]
    if "scale_shape" in bad:
        scales[si] = ([s[:-1], s[:, None], torch.cat([s, s[:1]]), s[None]] if s.dim() == 1 else
                      [s[:, :-1] if s.shape[1] > 1 else torch.cat([s, s], 1), s[..., :1], s.reshape(len(s), -1),
                       torch.cat([s, s[:1]])])[var].contiguous()
    if "scale_dtype" in bad:
        other = torch.bfloat16 if s.dtype == torch.float32 else torch.float32  # the other model's scales
        scales[si] = s.to([other, torch.float64, torch.float16, torch.int32][var])
    if "scale_layout" in bad:
        scales[si] = torch.stack([s, s], -1)[..., 0]  # every other element of a buffer twice the size
    if "float_weight" in bad:  # the float weight the codes stand for, in the model's dtype
        weights[wi] = dequantized(q, s, group).to(c["dtype"])
    if "codes_dtype" in bad:
        weights[wi] = [q.view(torch.uint8 if q.dtype == torch.int8 else torch.int8), q.to(torch.int32),
                       q.to(torch.int16), q.float()][var]
    if "codes_shape" in bad:
        weights[wi] = [torch.cat([q, q[:1]]), q[:, :-32], q[None], q[:-1]][var].contiguous()
    if "codes_layout" in bad:
        weights[wi] = q.t().contiguous().t()
    if "norm" in bad:
        ni = c["layer"] * 9 + (0 if var % 2 else 5)
        norm = weights[ni]
        weights[ni] = norm.double() if var < 2 else torch.cat([norm, norm[:1]])
    if "scale_count" in bad:
        scales = scales[:-1] if var % 2 else [*scales, scales[0]]
    if "weight_count" in bad:
        weights = weights[:-1] if var % 2 else [*weights, weights[0]]
    if "group" in bad:
        group = c["group"] if c["group"] != group else -1
    return weights, scales, group


def layers_q_valid(c: dict, model: Llama, x: torch.Tensor, cos: torch.Tensor, weights: list[torch.Tensor],
                   scales: list[torch.Tensor], group: int, k: torch.Tensor) -> bool:
    cfg = model.config
    L, D, d, inner = cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    Nq, Nkv = cfg.num_heads * d, cfg.num_kv_heads * d
    dtype = x.dtype
    model_ok = dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_kernel.bf16_rows())
    shapes = [(D,), (Nq, D), (Nkv, D), (Nkv, D), (D, Nq), (D,), (inner, D), (inner, D), (D, inner)]
    counts_ok = len(weights) == 9 * L and len(scales) == 7 * L
    weights_ok = counts_ok and all(
        (w.shape == shape and w.is_contiguous() and w.dtype == dtype) if len(shape) == 1 else
        quant_shape(w, scales[layer * 7 + PROJECTIONS.index(i)], group, (dtype,)) == shape
        for layer in range(L) for i, (w, shape) in enumerate(zip(weights[9 * layer:9 * layer + 9], shapes,
                                                                 strict=True))
    )
    max_len, n, lens = c["max_len"], c["n"], c["lens"]
    lens_after = lens + n + c["after_delta"]
    return (
        model_ok and weights_ok and tuple(x.shape) == (1, 1, D) and x.is_contiguous() and cos.dtype == dtype
        and k.dtype in cpu_kernel.DTYPES and c["layout"] != "transposed"
        and n in (0, 1) and 0 <= lens <= max_len - n and lens_after == lens + n and lens_after <= c["read_len"]
        and 1 <= c["read_len"] <= max_len
    )


def eager_layers(model: Llama, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, lens: torch.Tensor, n_new: torch.Tensor, lens_after: torch.Tensor, read_len: int,
                 max_len: int) -> torch.Tensor:
    """The eager quantized layers over k/v (written in place): "matmul" attention over a float32 cache (no kernel
    shared with the fused call but gemv_q), the decode kernel otherwise (matmul would compute in the cache's
    16-bit dtype)."""
    cfg = model.config
    impl = "matmul" if k.dtype == torch.float32 else "auto"
    groups = cfg.num_heads // cfg.num_kv_heads
    impl, mask = step_attention(impl, groups, cfg.num_kv_heads, lens_after, n_new, 1, read_len, cfg.head_dim,
                                k.dtype)
    with torch.no_grad():
        return run_blocks(model.layers, x, cos, sin, LayerSpan(k, v, lens, max_len), n_new, lens_after, read_len,
                          impl, mask)


@dataclass
class LayersCall:
    """A decode_layers_q case's arguments (k/v views of the guarded buffers kbuf/vbuf) and its model."""

    model: Llama
    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kbuf: torch.Tensor
    vbuf: torch.Tensor
    lens: torch.Tensor
    n_new: torch.Tensor
    lens_after: torch.Tensor
    weights: list[torch.Tensor]
    scales: list[torch.Tensor]
    group: int

    def valid(self, c: dict) -> bool:
        return layers_q_valid(c, self.model, self.x, self.cos, self.weights, self.scales, self.group, self.k)


def layers_q_call(h: Harness, c: dict) -> LayersCall:
    model = quantized_model(c["dtype"], c["scheme"], c["config"])
    cfg = model.config
    gen = torch.Generator().manual_seed(c["seed"])
    weights, scales, group = layers_q_tensors(c, model)
    shape = (cfg.num_layers, 1, cfg.num_kv_heads, c["max_len"] + 1, cfg.head_dim)
    k, kbuf = h.guarded(shape, c["kv_dtype"] or c["dtype"], c["layout"], gen)
    v, vbuf = h.guarded(shape, c["kv_dtype"] or c["dtype"], c["layout"], gen)
    x = torch.randn(1, 1, cfg.hidden_size, generator=gen).to(c["dtype"])
    position = torch.tensor([[c["lens"] if 0 <= c["lens"] <= 64 else 0]])  # [1, 1]
    cos, sin = rope.cos_sin(model.inv_freq, position, c["dtype"])  # [1, 1, 1, d/2]
    if "x" in c["bad"]:
        x = [x.double(), x[..., :-1].contiguous(), torch.cat([x, x], 1), torch.stack([x, x], -1)[..., 0]][c["variant"]]
    lens, n_new = torch.tensor([c["lens"]]), torch.tensor([c["n"]])
    lens_after = torch.tensor([c["lens"] + c["n"] + c["after_delta"]])
    return LayersCall(model, x, cos, sin, k, v, kbuf, vbuf, lens, n_new, lens_after, weights, scales, group)


def check_layers_q(h: Harness, guard: int, c: dict) -> None:
    a = layers_q_call(h, c)
    model, x, cos, sin, k, v, kbuf, vbuf = a.model, a.x, a.cos, a.sin, a.k, a.v, a.kbuf, a.vbuf
    lens, n_new, lens_after, weights, scales, group = a.lens, a.n_new, a.lens_after, a.weights, a.scales, a.group
    cfg = model.config
    kv = k.dtype
    given_tensors = [x, cos, sin, lens, n_new, lens_after, *weights, *scales]
    saved = [t.clone() for t in given_tensors]
    saved_k, saved_v = kbuf.clone(), vbuf.clone()
    out = None

    def call() -> None:
        nonlocal out
        out = OPS.decode_layers_q(x, cos, sin, k, v, lens, n_new, lens_after, c["read_len"], weights, scales, group,
                                  float(cfg.rms_norm_eps))

    h.note("decode_layers_q", c)
    err = h.raises(call)
    assert all(map(h.same_bits, saved, given_tensors)), f"an argument changed: {c}"
    valid = a.valid(c)
    h.tally("decode_layers_q", err is None)
    assert (err is None) == valid, f"valid={valid} but the call {'raised ' + repr(err) if err else 'ran'}: {c}"
    if err is not None:
        assert refused_by_check(err, "decode_layers"), f"refused by {err!r}, not by the op's checks: {c}"
        assert h.same_bits(kbuf, saved_k) and h.same_bits(vbuf, saved_v), f"a refused call wrote the cache: {c}"
        return
    pos = c["lens"] if c["n"] else c["max_len"]  # the slot's row; a padded slot goes to the spare row
    for buf, before in ((kbuf, saved_k), (vbuf, saved_v)):
        changed = (buf != before).flatten(0, -3).any(-1).any(0).nonzero().flatten().tolist()  # key-axis rows
        assert set(changed) <= {guard + pos}, f"rows {changed} written, only {guard + pos} may be: {c}"
    # The eager layers over a copy of the cache as it was: x after the layers, and the cache rows they write.
    view = slice(guard, guard + c["max_len"] + 1)
    k_ref, v_ref = (b[..., view, :cfg.head_dim].clone() for b in (saved_k, saved_v))
    want = eager_layers(model, x, cos, sin, k_ref, v_ref, lens, n_new, lens_after, c["read_len"], c["max_len"])
    assert out.shape == x.shape and out.dtype == x.dtype, c
    tol = dict(rtol=2e-2, atol=2e-2) if c["dtype"] == torch.bfloat16 or kv != torch.float32 else dict(
        rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, want, **tol, msg=lambda m: f"{m}\n{c}")
    torch.testing.assert_close(k, k_ref, **tol, msg=lambda m: f"k: {m}\n{c}")
    torch.testing.assert_close(v, v_ref, **tol, msg=lambda m: f"v: {m}\n{c}")
    if not c["bad"]:  # FusedLayers on the same model and a copy of the cache as it was: the same call
        k2, v2 = saved_k.clone(), saved_v.clone()
        k2v, v2v = k2[..., view, :cfg.head_dim], v2[..., view, :cfg.head_dim]
        again = FusedLayers(model, 0, cfg.num_layers)(x, cos, sin, k2v, v2v, lens, n_new, lens_after, c["read_len"])
        assert h.same_bits(again, out) and h.same_bits(k2, kbuf) and h.same_bits(v2, vbuf), c


def check_layers_q_cases(h: Harness, examples: int, guard: int) -> None:
    """`examples` drawn cases, a valid call of each scheme, dtype and model, then each break in each of its forms
    alone, for each scheme, in the first case drawn
    with a few cache rows and, but for the lengths' breaks, a token to write; the sweep's cases are picked without
    the validity rule, so that a wrong rule cannot pick the cases that hide it."""

    @drawn(examples)
    @given(layers_q_case(h))
    def cases(c: dict) -> None:
        check_layers_q(h, guard, c)

    cases()
    # A valid call of every scheme, dtype and model, with a token to write: how many of the drawn cases are valid
    # follows hypothesis's stream, which any change to what a case draws moves.
    for scheme, dtype, config in itertools.product(SCHEMES, (torch.float32, torch.bfloat16), sorted(CONFIGS)):
        case = find(layers_q_case(h, ("none", 0, scheme)), lambda c, d=dtype, m=config: (
            (c["dtype"], c["config"]) == (d, m) and c["max_len"] >= 3 and c["n"] == 1), settings=FIRST)
        check_layers_q(h, guard, case)
    lengths = {"n", "lens", "after", "read_len"}
    for bad, forms in LAYER_BREAKS.items():
        for form, scheme in itertools.product(range(forms), SCHEMES):
            case = find(layers_q_case(h, (bad, form, scheme)),
                        lambda c: c["max_len"] >= 3 and (c["n"] == 1 or c["bad"][0] in lengths), settings=FIRST)
            check_layers_q(h, guard, case)
