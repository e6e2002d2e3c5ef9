"""Weight-only quantization of a model's projections: int8 per output channel and int4 in groups along K.

Why: a batch-1 decode step reads every weight once per token, so its time is the weight bytes over the memory's
rate. int8 halves a bfloat16 model's projection bytes, int4 quarters them (plus a scale, and for int4 a zero, per
group). Activations, norms, the KV cache and the embedding (one row read per token) stay in the model's dtype;
every projection and the LM head (tied or not: a tied model gets a quantized copy of the embedding as its head)
are quantized.

Formats (`Scheme`):

* int8: symmetric, one scale per output channel: w ~ q * s, q in -128..127, s = max|w_row| / 127 rounded to the
  model's dtype. Stored as int8 [N, K] and the scales [N]; the product is torch's
  `aten._weight_int8pack_mm(x, q, s)` (one row and chunks alike).
* int4: asymmetric, one scale and one offset per group of `group` (32, 64 or 128) consecutive inputs of a row:
  w ~ (q - 8) * s + z, q in 0..15, z = lo + 8 * s, s = (hi - lo) / 15 over the group's range, both rounded to the
  model's dtype (torch's tinygemm convention). The range is the one of a small search of shrunk ranges that
  minimises the group's squared error (as llama.cpp's k-quants search their scales): outliers clipped where that
  costs less than the coarser steps they force. Stored as torch's CPU int4 layout
  (`aten._convert_weight_to_int4pack_for_cpu`: uint8 [N, K / 2], laid out for this CPU's vector width, so it is
  packed at load on the machine that runs it) and scales_and_zeros [K / group, N, 2]; the product is
  `aten._weight_int4pack_mm_for_cpu`.

Both products are aten ops: eager and compiled steps call the same kernel (inductor calls it as an extern
kernel), so compiled tokens are eager tokens. Measured one-row rates on the 2-vCPU Xeon: profiles/quant_kernels.py
and profiles/RESULTS.md ("Quantized weights").

`quantize_model(model, "int8" | "int4" | Scheme)` rewrites a loaded model in place (`static_decode.loading.load_model
(quantize=...)` calls it after loading, so a tensor-parallel rank quantizes its own slices: its groups are whole
groups of the checkpoint's rows); `QuantWeight.dequantize` gives the weight the products use, for references.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from static_decode.parallel import shard_dim

INT4_GROUPS = (32, 64, 128)
DEFAULT_INT4_GROUP = 32  # the finest group: +quality at +1/16 of the bytes; as fast as 64 and 128 (measured)
DTYPES = (torch.float32, torch.bfloat16)  # model dtypes the quantized products take
# The shrink factors of the int4 range search (1.0: the plain min/max range).
INT4_SHRINK = tuple(1.0 - 0.02 * i for i in range(11))


@dataclass(frozen=True)
class Scheme:
    """A weight-only format: `bits` 8 (per output channel, group 0) or 4 (grouped along K by `group`)."""

    bits: int
    group: int = 0

    def __post_init__(self) -> None:
        if self.bits == 8 and self.group != 0:
            raise ValueError(f"int8 is per output channel (group 0), got group {self.group}")
        if self.bits == 4 and self.group not in INT4_GROUPS:
            raise ValueError(f"int4 group size must be one of {INT4_GROUPS}, got {self.group}")
        if self.bits not in (4, 8):
            raise ValueError(f"quantization bits must be 8 or 4, got {self.bits}")

    @property
    def name(self) -> str:
        return "int8" if self.bits == 8 else f"int4-g{self.group}"


CHOICES = ("int8", "int4", *(f"int4-g{g}" for g in INT4_GROUPS))  # what `parse` (and --quantize) take


def parse(spec: str | Scheme | None) -> Scheme | None:
    """A Scheme from "int8", "int4" (the default group), "int4-g32" / "int4-g64" / "int4-g128"; None and "none"
    give None (no quantization)."""
    if spec is None or isinstance(spec, Scheme):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"quantize must be a string such as 'int8' or 'int4', got {type(spec).__name__}")
    text = spec.strip().lower()
    if text in ("none", ""):
        return None
    if text == "int8":
        return Scheme(8)
    m = re.fullmatch(r"int4(?:-g(\d+))?", text)
    if m is None or (m.group(1) is not None and int(m.group(1)) not in INT4_GROUPS):
        raise ValueError(f"quantize must be one of {', '.join(CHOICES)} or none, got {spec!r}")
    return Scheme(4, int(m.group(1)) if m.group(1) else DEFAULT_INT4_GROUP)


# ---- quantizers: plain tensor code, the formats' definitions ---------------------------------------------------
def quantize_int8(
    w: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], s [N] in `dtype`): w ~ q * s, symmetric per output channel. `amax` [N]: each
    row's largest |w| when w is a slice of the rows (a tensor-parallel rank's), so the slice gets the whole rows'
    scales."""
    wf = w.float()
    amax = wf.abs().amax(dim=1) if amax is None else amax.float()
    s = (amax / 127).clamp(min=torch.finfo(torch.float32).tiny).to(dtype)  # [N]
    q = torch.round(wf / s.float()[:, None]).clamp(-128, 127).to(torch.int8)  # [N, K]
    return q, s


def quantize_int4(
    w: torch.Tensor, group: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int32 [N, K] in 0..15, s [N, K / group], z [N, K / group] in `dtype`):
    w ~ (q - 8) * s + z per group, the range of each group the shrunk one of least squared error."""
    N, K = w.shape
    g = w.float().reshape(N, K // group, group)  # [N, G, group]
    lo0, hi0 = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)  # [N, G, 1]
    best_err = best_q = best_s = best_z = None
    for shrink in INT4_SHRINK:
        s, z, q = _int4_at(g, lo0 * shrink, hi0 * shrink, dtype)
        err = ((q - 8) * s + z - g).pow(2).sum(-1, keepdim=True)  # [N, G, 1]
        if best_err is None:
            best_err, best_q, best_s, best_z = err, q, s, z
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_q, best_s, best_z = (torch.where(better, a, b) for a, b in ((q, best_q), (s, best_s), (z, best_z)))
    q = best_q.to(torch.int32).reshape(N, K)
    return q, best_s.squeeze(-1).to(dtype), best_z.squeeze(-1).to(dtype)


def _int4_at(
    g: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scale, offset (rounded to `dtype`, returned as float32) and codes (float32) of groups g [N, G, group] for the
    range lo..hi [N, G, 1]."""
    s = ((hi - lo) / 15).clamp(min=1e-12).to(dtype).float()  # [N, G, 1]
    z = (lo + 8 * s).to(dtype).float()
    q = torch.round((g - z) / s + 8).clamp(0, 15)  # [N, G, group]
    return s, z, q


# ---- the stored weight and its product -------------------------------------------------------------------------
def int4_block() -> tuple[int, bool]:
    """(rows per block, halves) of `aten._convert_weight_to_int4pack_for_cpu` on this CPU (ATen's int4mm_kernel.cpp):
    blocks of 4 float vectors' worth of rows (64 on AVX-512, 32 otherwise), K bytes of block/2 each; byte j of a
    full block holds rows j (low nibble) and j + block/2 (high) on AVX-512 and AVX2 ("halves"), rows 2j and 2j + 1
    in the portable build and in a last, partial block."""
    cap = torch.backends.cpu.get_cpu_capability()
    return (64 if cap == "AVX512" else 32), cap in ("AVX512", "AVX2")


def unpack_int4(packed: torch.Tensor, N: int, K: int, layout: tuple[int, bool] | None = None) -> torch.Tensor:
    """The codes [N, K] (uint8, 0..15) of an int4 weight in torch's CPU layout `layout` (default `int4_block()`;
    tested against the layout's own product: tests/test_quant.py)."""
    block, halves = int4_block() if layout is None else layout
    flat = packed.reshape(-1)
    full = N // block * block  # rows in whole blocks
    parts = []
    if full:
        b = flat[: full * K // 2].view(full // block, K, block // 2)  # [NB, K, block/2]
        lo, hi = b & 15, b >> 4
        rows = torch.cat([lo, hi], 2) if halves else torch.stack([lo, hi], -1).view(full // block, K, block)
        parts.append(rows.transpose(1, 2).reshape(full, K))  # [full, K]
    if full < N:
        b = flat[full * K // 2:].view(K, (N - full) // 2)  # [K, rest/2]: pairs of rows
        parts.append(torch.stack([b & 15, b >> 4], -1).view(K, N - full).t())  # [rest, K]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class QuantWeight(nn.Module):
    """A quantized [N, K] weight in the layout its product reads. `shape` is the float weight's; `dtype` the
    dtype of the activations it multiplies (the model's); its tensors are buffers (moved by .to(), saved by
    state_dict, counted by `nbytes`)."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor, scheme: Scheme, amax: torch.Tensor | None = None) -> None:
        super().__init__()
        N, K = weight.shape
        dtype = weight.dtype
        if dtype not in DTYPES:
            raise ValueError(f"quantized weights take a float32 or bfloat16 model, got {dtype}")
        if scheme.bits == 4 and K % scheme.group:
            raise ValueError(f"int4 group {scheme.group} does not divide the weight's {K} inputs; use "
                             f"{' or '.join(f'int4-g{g}' for g in INT4_GROUPS if K % g == 0) or 'int8'}")
        if scheme.bits == 4 and N % 16:
            raise ValueError(f"int4 needs a multiple of 16 output rows (torch's CPU int4 layout), got {N}; use int8")
        self.scheme, self.out_features, self.in_features = scheme, N, K
        self.layout = int4_block()  # asked here, once: a compiled step cannot trace the CPU capability query
        if scheme.bits == 8:
            q, s = quantize_int8(weight, dtype, amax)
            self.register_buffer("qweight", q)  # int8 [N, K]
            self.register_buffer("scales", s)  # [N]
        else:
            q, s, z = quantize_int4(weight, scheme.group, dtype)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.cpu(), 1).to(weight.device)  # [N, K/2]
            sz = torch.stack([s, z], dim=-1).transpose(0, 1).contiguous()  # [K/group, N, 2]
            self.register_buffer("qweight", packed)
            self.register_buffer("scales", sz)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (the model's dtype) times the weight's transpose -> [..., N] in x's dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if x2.shape[0] != 1:
            # Several rows (prefill chunks, verify steps): the weight dequantized in x's dtype, then the float GEMM.
            # torch's int8/int4 CPU kernels take rows one at a time: a 256-row chunk by SmolLM2's gate/up ran 33x
            # (int8) to 52x (int4) slower than F.linear in float32, 3-4x in bfloat16; the dequantization costs a
            # pass over the weight (profiles/RESULTS.md, "Quantized weights").
            return torch.nn.functional.linear(x2, self.dequantize(x.dtype)).reshape(*lead, self.out_features)
        if self.scheme.bits == 8:
            out = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)  # [1, N]
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.scheme.group, self.scales)
        return out.reshape(*lead, self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The weight [N, K] the products multiply by, in `dtype` (float64: exact from the stored codes and
        scales; the model's dtype: what the several-row products use)."""
        N, K = self.shape
        if self.scheme.bits == 8:
            return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]  # [N, K]
        g = self.scheme.group
        q = self.codes().to(dtype).view(N, K // g, g)  # [N, G, group]
        s, z = self.scales.to(dtype).unbind(-1)  # [G, N] each
        return ((q - 8) * s.t()[..., None] + z.t()[..., None]).view(N, K)

    def codes(self) -> torch.Tensor:
        """int4: the codes q [N, K] (uint8, 0..15) unpacked from torch's CPU layout (`unpack_int4`)."""
        return unpack_int4(self.qweight, self.out_features, self.in_features, self.layout)

    def extra_repr(self) -> str:
        return f"{self.scheme.name}, out={self.out_features}, in={self.in_features}"

    @classmethod
    def from_stored(cls, qweight: torch.Tensor, scales: torch.Tensor, scheme: Scheme, in_features: int) -> QuantWeight:
        """The weight from the tensors `__init__` would have stored (a saved quantized checkpoint,
        static_decode.quant_io, which checks their shapes and dtypes against the config first): no quantization."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.scheme, self.out_features, self.in_features = scheme, qweight.shape[0], in_features
        self.register_buffer("qweight", qweight)  # int8 [N, K] / uint8 [N, K / 2]
        self.register_buffer("scales", scales)  # [N] / [N, K / group, 2]
        return self


class QuantLinear(nn.Module):
    """An nn.Linear whose `weight` is a QuantWeight (`bias` stays in the model's dtype). The model's projections
    call `static_decode.projection.linear(x, module.weight, module.bias)`, which takes either kind of weight."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, scheme: Scheme, amax: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.weight = QuantWeight(weight.detach(), scheme, amax)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features, self.out_features = self.weight.in_features, self.weight.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.weight.matmul(x)
        return out if self.bias is None else out + self.bias

    @classmethod
    def from_stored(cls, weight: QuantWeight, bias: torch.Tensor | None) -> QuantLinear:
        """A QuantLinear over an already quantized weight (`QuantWeight.from_stored`)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = weight.in_features, weight.out_features
        return self


def quantize_model(model: nn.Module, spec: str | Scheme) -> nn.Module:
    """Quantize, in place, every nn.Linear of `model` (each projection of every layer and the LM head; a tied
    model gets a quantized head of its own, the embedding staying in the model's dtype for its row lookups).
    Refuses, in one line naming it, a model dtype or device the products do not take, or a quantized model."""
    scheme = parse(spec)
    if scheme is None:
        return model
    if scheme_of(model) is not None:
        raise ValueError(f"the model is already quantized ({scheme_of(model).name})")
    embed = model.embed_tokens.weight
    if embed.dtype not in DTYPES:
        raise ValueError(f"--quantize {scheme.name} takes a float32 or bfloat16 model, not {embed.dtype}")
    if embed.device.type != "cpu":
        raise ValueError(f"--quantize {scheme.name} runs on the CPU (torch's int8/int4 CPU kernels), "
                         f"the model is on {embed.device}")
    targets = [
        (module, child, f"{name}.{child}" if name else child, linear)
        for name, module in model.named_modules()
        for child, linear in module.named_children()
        if isinstance(linear, nn.Linear)
    ]
    if model.lm_head is None:  # tied: the head reads its own quantized copy of the embedding
        targets.append((model, "lm_head", "lm_head (tied to embed_tokens)", None))
    for _, _, full, linear in targets:  # every layer checked before any is replaced: a refusal changes nothing
        K = embed.shape[1] if linear is None else linear.in_features
        if scheme.bits == 4 and K % scheme.group:
            raise ValueError(f"{full}: int4 group {scheme.group} does not divide the weight's {K} inputs; use "
                             f"{' or '.join(f'int4-g{g}' for g in INT4_GROUPS if K % g == 0) or 'int8'}")
    for module, child, full, linear in targets:
        weight, bias = (embed, None) if linear is None else (linear.weight, linear.bias)
        setattr(module, child, QuantLinear(weight, bias, scheme, _row_amax(model, full, weight, scheme)))
    model.quantization = scheme
    return model


def _row_amax(model: nn.Module, name: str, weight: torch.Tensor, scheme: Scheme) -> torch.Tensor | None:
    """int8 on a tensor-parallel rank: each row's largest |w| over every rank's slice of a row-parallel weight
    (o_proj, down_proj split along K), so a rank's scales are the single process's and the shards add up to it
    (int4 groups are whole within a slice: nothing to share). None elsewhere, and for a shard loaded without its
    process group (its slices then get scales of their own)."""
    import torch.distributed as dist

    tp = getattr(model, "tp", None)
    if scheme.bits != 8 or tp is None or not tp.enabled or shard_dim(f"{name}.weight") != 1:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    amax = weight.detach().float().abs().amax(dim=1)  # [N]
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp.group)
    return amax


def scheme_of(model: nn.Module) -> Scheme | None:
    """The Scheme a model was quantized with, None for a float model."""
    return getattr(model, "quantization", None)


def read_bytes(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads: `weight_bytes` less the embedding where the head does not read
    it (untied, or tied and quantized: the head reads its own copy); a step looks up one embedding row."""
    embed = model.embed_tokens.weight
    head_reads_embedding = model.lm_head is None
    return weight_bytes(model) - (0 if head_reads_embedding else embed.nbytes - embed[0].nbytes)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight a model holds (parameters and quantized buffers; not the rotary table), counting a
    tensor shared by two modules once."""
    seen: set[int] = set()
    total = 0
    for t in (*model.parameters(), *(b for m in model.modules() if isinstance(m, QuantWeight) for b in m.buffers())):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.nbytes
    return total
