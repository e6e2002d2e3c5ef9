"""Weight-only quantization of a model's projections: int8 per output channel and int4 in groups along K.

A batch-1 decode step reads every weight once per token, so int8 halves a bfloat16 model's projection bytes and int4
quarters them. Every projection and the LM head are quantized; activations, norms, the cache and the embedding stay
in the model's dtype. int8: w ~ q * s per output channel; int4: w ~ (q - 8) * s + z per group along K (tinygemm's
convention), two codes a byte. One row on the CPU goes through our kernel (`gemv_q`, eager and compiled alike),
several rows through the weight dequantized a block of rows at a time (`linear_q`); CUDA through
static_decode.model.quant_cuda.
`quantize_model(model, "int8" | "int4" | Scheme)` rewrites a loaded model in place; `QuantWeight.dequantize` gives
the weight the products use. Formats in full: docs/internals.md#quant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from static_decode.kernels import cpu_kernel
from static_decode.model import quant_cuda
from static_decode.model.gguf_quant import BlockLinear, Blocks, BlockWeight
from static_decode.model.gguf_quantize import QUANTIZABLE, quant_refusal, quantize_blocks
from static_decode.model.parallel import shard_dim

INT4_GROUPS = (32, 64, 128)
DEFAULT_INT4_GROUP = 32  # the finest group: +quality at +1/16 of the bytes; as fast as 64 and 128 (measured)
DTYPES = (torch.float32, torch.bfloat16)  # model dtypes the quantized products take
# Dequantized weights of at least this many bytes take the blocked product of several rows (`linear_q`): the
# largest allocation glibc serves from its heap, so a larger whole dequantized weight is a fresh mapping paged in on
# every call; smaller ones multiplied faster whole (profiles/RESULTS.md, "Quantized prefill by row blocks").
BLOCKED_BYTES = 32 << 20
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


CHOICES = ("int8", "int4", *(f"int4-g{g}" for g in INT4_GROUPS))  # our schemes (what a saved checkpoint holds)
BLOCK_CHOICES = tuple(k.lower() for k in QUANTIZABLE)  # GGUF blocks quantized at load (model.gguf_quantize)
LOAD_CHOICES = (*CHOICES, *BLOCK_CHOICES)  # what `parse` (and --quantize) take


def parse(spec: str | Scheme | Blocks | None) -> Scheme | Blocks | None:
    """A Scheme from "int8", "int4" (the default group), "int4-g32" / "int4-g64" / "int4-g128"; GGUF blocks from
    "q8_0", "q4_k", "q5_k", "q6_k"; None and "none" give None (no quantization)."""
    if spec is None or isinstance(spec, (Scheme, Blocks)):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"quantize must be a string such as 'int8' or 'int4', got {type(spec).__name__}")
    text = spec.strip().lower()
    if text in ("none", ""):
        return None
    if text in BLOCK_CHOICES:
        return Blocks((text.upper(),))
    if text == "int8":
        return Scheme(8)
    m = re.fullmatch(r"int4(?:-g(\d+))?", text)
    if m is None or (m.group(1) is not None and int(m.group(1)) not in INT4_GROUPS):
        raise ValueError(f"quantize must be one of {', '.join(LOAD_CHOICES)} or none, got {spec!r}")
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


def int4_refusal(K: int, group: int) -> str | None:
    """Why an int4 weight with K inputs cannot take groups of `group` (None when it can): the packed layout's chunks
    of 64 columns and the groups must divide K."""
    if K % INT4_CHUNK == 0 and K % group == 0:
        return None
    fits = [f"int4-g{g}" for g in INT4_GROUPS if K % g == 0] if K % INT4_CHUNK == 0 else []
    return f"int4 takes a weight whose {K} inputs are a multiple of {INT4_CHUNK} and of the group {group}; use " + (
        " or ".join(fits) or "int8")


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
INT4_CHUNK = 64  # columns per packed chunk: its 32 bytes hold columns j (low nibble) and j + 32 (high nibble)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes q [N, K] (0..15, K a multiple of 64) -> uint8 [N, K / 2]: in each chunk of 64 columns, byte j holds
    column j in its low nibble and column j + 32 in its high one (csrc/gemv_quant.cpp widens a chunk's 32 bytes
    to two runs of 32 consecutive columns with a few bit operations)."""
    N, K = q.shape
    c = q.to(torch.uint8).view(N, K // INT4_CHUNK, 2, INT4_CHUNK // 2)  # [N, chunks, 2, 32]
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(N, K // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] (`pack_int4`'s layout) -> the codes [N, K] (uint8, 0..15)."""
    N, half = packed.shape
    b = packed.view(N, half // (INT4_CHUNK // 2), INT4_CHUNK // 2)  # [N, chunks, 32]
    return torch.stack([b & 15, b >> 4], dim=2).view(N, 2 * half)  # [N, chunks, 2, 32] -> [N, K]


class QuantWeight(nn.Module):
    """A quantized [N, K] weight in the layout its product reads. `shape` is the float weight's; `dtype` the
    dtype of the activations it multiplies (the model's); its tensors are buffers (moved by .to(), saved by
    state_dict, counted by `nbytes`)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    tinygemm_on: str | None = None  # int4: the device type `use_int4_kernel("tinygemm")` prepared operands for

    def __init__(self, weight: torch.Tensor, scheme: Scheme, amax: torch.Tensor | None = None) -> None:
        super().__init__()
        N, K = weight.shape
        dtype = weight.dtype
        if dtype not in DTYPES:
            raise ValueError(f"quantized weights take a float32 or bfloat16 model, got {dtype}")
        if scheme.bits == 4 and (why := int4_refusal(K, scheme.group)):
            raise ValueError(why)
        self.scheme, self.out_features, self.in_features = scheme, N, K
        if scheme.bits == 8:
            q, s = quantize_int8(weight, dtype, amax)
            self.register_buffer("qweight", q)  # int8 [N, K]
            self.register_buffer("scales", s)  # [N]
        else:
            q, s, z = quantize_int4(weight, scheme.group, dtype)
            self.register_buffer("qweight", pack_int4(q))  # uint8 [N, K / 2]
            self.register_buffer("scales", torch.stack([s, z], dim=-1))  # [N, K / group, 2]: (s, z) per group

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
        if self.tinygemm_on == self.device.type and x2.shape[0] <= quant_cuda.TINYGEMM_ROWS:  # `use_int4_kernel`
            out = quant_cuda.tinygemm_matmul(x2, self.tinygemm_weight, self.tinygemm_scales, self.scheme.group)
        elif x2.shape[0] == 1 and self.device.type == "cpu" and cpu_kernel.available():
            # One row on the CPU: our kernel (csrc/gemv_quant.cpp), eager and compiled alike.
            group = 0 if self.scheme.bits == 8 else self.scheme.group
            out = torch.ops.static_decode_cpu.gemv_q(x2, self.qweight, self.scales, group)  # [N]
        elif x2.shape[0] == 1 and self.device.type == "cpu" and self.scheme.bits == 8:
            out = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)  # [1, N] (no kernels built)
        # static_decode.model.quant_cuda (one row: a reduction)
        elif self.device.type == "cuda" and self.scheme.bits == 8:
            out = quant_cuda.int8_matmul(x2, self.qweight, self.scales)  # [M, N]
        elif self.device.type == "cuda" and x2.shape[0] == 1:  # int4, one row: one fused reduction over the bytes
            out = quant_cuda.int4_row(x2, self.qweight, self.scales, self.scheme.group)  # [1, N]
        elif (self.device.type == "cpu" and x.dtype in DTYPES and cpu_kernel.available()
              and self.in_features * self.out_features * x.element_size() >= BLOCKED_BYTES):
            # Several rows (prefill chunks, verify steps) by a large weight on the CPU: dequantized a block of rows
            # at a time in x's dtype, each block through the float GEMM while it is in cache (csrc/linear_quant.cpp).
            group = 0 if self.scheme.bits == 8 else self.scheme.group
            out = torch.ops.static_decode_cpu.linear_q(x2, self.qweight, self.scales, group)  # [M, N]
        else:
            # Several rows by a smaller weight, or without our kernels: the weight dequantized whole in x's dtype
            # (dequant_q on the CPU: one pass), then the float GEMM. torch's int8/int4 CPU kernels take rows one at
            # a time: 33-52x slower for a 256-row chunk (profiles/RESULTS.md, "Quantized weights").
            out = torch.nn.functional.linear(x2, self.dequantize(x.dtype))  # [M, N]
        return out.reshape(*lead, self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The weight [N, K] the products multiply by, in `dtype` (float64: exact from the stored codes and
        scales; the model's dtype: what the several-row products use, computed in float32 and rounded once, as the
        one-row kernel multiplies in float32)."""
        N, K = self.shape
        group = 0 if self.scheme.bits == 8 else self.scheme.group
        if dtype in DTYPES and self.device.type == "cpu" and cpu_kernel.available():
            return torch.ops.static_decode_cpu.dequant_q(self.qweight, self.scales, group, dtype)  # one pass
        math = torch.float64 if dtype == torch.float64 else torch.float32
        if self.scheme.bits == 8:
            return (self.qweight.to(math) * self.scales.to(math)[:, None]).to(dtype)  # [N, K]
        q = self.codes().to(math).view(N, K // group, group)  # [N, G, group]
        s, z = self.scales.to(math).unbind(-1)  # [N, G] each
        return ((q - 8) * s[..., None] + z[..., None]).view(N, K).to(dtype)

    def codes(self) -> torch.Tensor:
        """int4: the codes q [N, K] (uint8, 0..15) unpacked from the packed layout (`unpack_int4`)."""
        return unpack_int4(self.qweight)

    def use_int4_kernel(self, kernel: str) -> None:
        """int4: the product of up to quant_cuda.TINYGEMM_ROWS rows through torch's tinygemm ("tinygemm": its
        operands prepared here, on this device, as buffers beside the stored ones and not saved) or the default
        ("reduce": they are dropped). Refused, naming why, where tinygemm does not take the weight."""
        quant_cuda.check_int4_kernel(kernel)
        if self.scheme.bits != 4:
            raise ValueError(f"an int4 kernel takes int4 weights, this one is {self.scheme.name}")
        self.tinygemm_on = None
        for name in ("tinygemm_weight", "tinygemm_scales"):
            self._buffers.pop(name, None)
        if kernel == "tinygemm":
            if why := quant_cuda.tinygemm_refusal(self.device, self.dtype, *self.shape):
                raise ValueError(why)
            packed, scales = quant_cuda.tinygemm_operands(self.codes(), self.scales)
            self.register_buffer("tinygemm_weight", packed, persistent=False)  # tinygemm's layout of the codes
            self.register_buffer("tinygemm_scales", scales, persistent=False)  # [K / group, N, 2]
            self.tinygemm_on = self.device.type

    def extra_repr(self) -> str:
        return f"{self.scheme.name}, out={self.out_features}, in={self.in_features}"

    @classmethod
    def from_stored(cls, qweight: torch.Tensor, scales: torch.Tensor, scheme: Scheme, in_features: int) -> QuantWeight:
        """The weight from the tensors `__init__` would have stored (a saved quantized checkpoint,
        static_decode.checkpoints.quant_io, which checks their shapes and dtypes against the config first): no
        quantization."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.scheme, self.out_features, self.in_features = scheme, qweight.shape[0], in_features
        self.register_buffer("qweight", qweight)  # int8 [N, K] / uint8 [N, K / 2]
        self.register_buffer("scales", scales)  # [N] / [N, K / group, 2]
        return self


class QuantLinear(nn.Module):
    """An nn.Linear whose `weight` is a QuantWeight (`bias` stays in the model's dtype). The model's projections
    call `static_decode.model.projection.linear(x, module.weight, module.bias)`, which takes either kind of weight."""

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
    if isinstance(scheme, Blocks) and getattr(model, "tp", None) is not None and model.tp.enabled:
        raise ValueError(f"--quantize {scheme.types[0].lower()}: GGUF blocks are not sliced across tensor-parallel "
                         "ranks; use int8 or int4")
    embed = model.embed_tokens.weight
    if embed.dtype not in DTYPES:
        raise ValueError(f"--quantize {scheme.name} takes a float32 or bfloat16 model, not {embed.dtype}")
    if embed.device.type not in ("cpu", "cuda"):
        raise ValueError(f"--quantize {scheme.name} runs on the CPU or CUDA, the model is on {embed.device}")
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
        why = (quant_refusal(K, scheme.types[0]) if isinstance(scheme, Blocks)
               else int4_refusal(K, scheme.group) if scheme.bits == 4 else None)
        if why:
            raise ValueError(f"{full}: {why}")
    for module, child, full, linear in targets:
        weight, bias = (embed, None) if linear is None else (linear.weight, linear.bias)
        if isinstance(scheme, Blocks):  # GGUF blocks, quantized here (static_decode.model.gguf_quantize)
            kind = scheme.types[0]
            blocks = BlockWeight(quantize_blocks(weight.detach(), kind), kind, weight.shape[1], weight.dtype)
            setattr(module, child, BlockLinear(blocks, None if bias is None else bias.detach()))
            continue
        setattr(module, child, QuantLinear(weight, bias, scheme, _row_amax(model, full, weight, scheme)))
    model.quantization = scheme
    return model


def _row_amax(model: nn.Module, name: str, weight: torch.Tensor, scheme: Scheme) -> torch.Tensor | None:
    """int8 on a tensor-parallel rank: each row's largest |w| over every rank's slice of a row-parallel weight
    (o_proj, down_proj), so a rank's scales are the single process's (int4 groups are whole within a slice). None
    elsewhere, and for a shard loaded without its process group (its slices then get scales of their own)."""
    import torch.distributed as dist

    tp = getattr(model, "tp", None)
    if scheme.bits != 8 or tp is None or not tp.enabled or shard_dim(f"{name}.weight") != 1:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    amax = weight.detach().float().abs().amax(dim=1)  # [N]
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp.group)
    return amax


def scheme_of(model: nn.Module) -> Scheme | Blocks | None:
    """The Scheme a model was quantized with, None for a float model."""
    return getattr(model, "quantization", None)


def use_int4_kernel(model: nn.Module, kernel: str) -> nn.Module:
    """The setting of an int4 model's product of few rows (static_decode.model.quant_cuda): "reduce" (the default, what
    a quantized model uses unless told otherwise: inductor's fused reduction on CUDA) or "tinygemm" (torch's
    `_weight_int4pack_mm`, bfloat16 on CUDA; on the CPU its CPU counterpart). Every weight is checked before any
    changes: a refusal names the layer and leaves the model as it was."""
    quant_cuda.check_int4_kernel(kernel)
    if (scheme := scheme_of(model)) is None or scheme.bits != 4:
        raise ValueError(f"an int4 kernel takes an int4 model, this one is {scheme.name if scheme else 'float'}")
    weights = [(name, m) for name, m in model.named_modules() if isinstance(m, QuantWeight)]
    for name, m in weights:
        if kernel == "tinygemm" and (why := quant_cuda.tinygemm_refusal(m.device, m.dtype, *m.shape)):
            raise ValueError(f"{name.removesuffix('.weight')}: {why}")
    for _, m in weights:
        m.use_int4_kernel(kernel)
    return model


def read_bytes(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads: `weight_bytes` less the embedding where the head does not read
    it (untied, or tied and quantized: the head reads its own copy); a step looks up one embedding row."""
    embed = model.embed_tokens.weight
    head_reads_embedding = model.lm_head is None
    return weight_bytes(model) - (0 if head_reads_embedding else embed.nbytes - embed.nbytes // embed.shape[0])


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight a model holds (parameters and quantized weights as stored; not the rotary table, nor
    the tinygemm operands `use_int4_kernel` prepares beside an int4 weight, which a step reads in its place, byte
    for byte), counting a tensor shared by two modules once."""
    seen: set[int] = set()
    total = 0
    stored = (t for m in model.modules() if isinstance(m, (QuantWeight, BlockWeight))
              for t in ((m.qweight, m.scales) if isinstance(m, QuantWeight) else (m.blocks,)))
    for t in (*model.parameters(), *stored):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.nbytes
    return total
