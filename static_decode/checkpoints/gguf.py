"""Load a GGUF file (llama.cpp's format) into the project's model: hyperparameters from its metadata, its tensors.

Read with the `gguf` package's GGUFReader (a memory map): architectures "llama" (also Mistral's), "qwen2", "qwen3";
tensors by gguf's own name table, each checked against the config before any data is read. F32/F16/BF16 go into the
model's dtype, Q4_0 projections into the exactly equal int4-g32 layout (a float32 model), every other quantized type
is dequantized, saying which on stderr; llama.cpp's q/k row permutation is undone. Details: docs/internals.md#gguf;
the tokenizer and template: static_decode.checkpoints.gguf_vocab.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from static_decode.base.hugepages import to_huge_pages
from static_decode.checkpoints import gguf_plan
from static_decode.checkpoints.gguf_plan import FLOAT_TYPES, model_linears
from static_decode.model.config import LlamaConfig, RopeConfig
from static_decode.model.gguf_quant import BlockEmbedding, BlockLinear, Blocks, BlockWeight
from static_decode.model.joining import join_projections
from static_decode.model.llama import Llama, hf_name
from static_decode.model.parallel import SINGLE, TensorParallel, shard_dim
from static_decode.model.quant import QuantLinear, QuantWeight, Scheme, pack_int4, quantize_model

SUFFIX = ".gguf"
# general.architecture -> the transformers architecture whose switches it runs with (static_decode.model.config)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
INT4_EXACT = Scheme(4, 32)  # what a Q4_0 block is, exactly, in a float32 model
Q4_0_BLOCK = 18  # bytes of a Q4_0 block: a float16 scale, then 16 bytes of 32 codes
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency rope divisors (Llama 3.x)
EOG_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def is_gguf(path: str | Path) -> bool:
    """True when `path` names a GGUF file (its suffix; the magic is checked when it is read)."""
    return str(path).lower().endswith(SUFFIX)


def open_gguf(path: str | Path) -> Any:
    """The file's gguf.GGUFReader; a missing, truncated or foreign file is refused in one line naming it."""
    from gguf import GGUFReader

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"GGUF file {file} does not exist")
    try:
        return GGUFReader(file)
    except Exception as e:  # the reader raises ValueError, IndexError or struct errors on a damaged file
        lines = str(e).strip().splitlines()
        raise ValueError(f"{file} is not a readable GGUF file: {lines[0] if lines else type(e).__name__}") from e


def field(reader: Any, key: str, file: Path, default: Any = ...) -> Any:
    """Metadata value `key` (a Python scalar, string or list); absent: `default`, or an error naming key and file."""
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise ValueError(f"{file} lacks GGUF metadata key {key!r}")
        return default
    return f.contents()


def _float(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.999999974752427e-07)."""
    return float(str(np.float32(value)))


def eos_ids(reader: Any) -> tuple[int, ...]:
    """The ids that end a sequence: EOS, end-of-turn and end-of-message, where the file gives them."""
    out: list[int] = []
    for key in EOG_KEYS:
        f = reader.fields.get(key)
        if f is not None and int(f.contents()) not in out:
            out.append(int(f.contents()))
    return tuple(out)


def architecture(reader: Any, file: Path) -> str:
    arch = field(reader, "general.architecture", file)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{file}: GGUF key 'general.architecture' is {arch!r}; static-decode loads "
                         f"{', '.join(ARCHITECTURES)}")
    return arch


def gguf_config(reader: Any, file: Path) -> LlamaConfig:
    """The model config the file's metadata and tensor names describe (EOS ids included); errors name the GGUF key
    and the file."""
    arch = architecture(reader, file)
    names = {t.name for t in reader.tensors}

    def key(name: str, default: Any = ...) -> Any:
        return field(reader, f"{arch}.{name}", file, default)

    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    if key("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{file}: GGUF key '{arch}.attention.value_length' {key('attention.value_length')} differs "
                         f"from the key length {head_dim}; static-decode's heads have one width")
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{file}: GGUF key '{arch}.rope.dimension_count' is {key('rope.dimension_count')}, a "
                         f"partial rotary embedding over a head of {head_dim}; only full rotation is supported")
    scaling = key("rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{file}: GGUF key '{arch}.rope.scaling.type' is {scaling!r}; only 'none' is supported")
    factors = ()
    if ROPE_FREQS in names:  # Llama 3.x's scaling as llama.cpp writes it: one divisor per frequency
        t = next(t for t in reader.tensors if t.name == ROPE_FREQS)
        if t.tensor_type.name != "F32" or int(t.n_elements) != head_dim // 2:
            raise ValueError(f"{file}: {ROPE_FREQS} is {t.tensor_type.name} of {int(t.n_elements)} values; "
                             f"float32 of head_dim / 2 = {head_dim // 2} wanted")
        factors = tuple(float(v) for v in np.asarray(t.data, dtype=np.float32))
    vocab = key("vocab_size", None) or len(field(reader, "tokenizer.ggml.tokens", file))
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=heads,
        num_kv_heads=key("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=_float(key("attention.layer_norm_rms_epsilon")),
        rope=RopeConfig(theta=_float(key("rope.freq_base", 10000.0)), freq_factors=factors),
        max_position_embeddings=key("context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_gate.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_window=key("attention.sliding_window", None),
        architecture=ARCHITECTURES[arch],
        eos_token_ids=eos_ids(reader),
    )


def gguf_names(arch: str, config: LlamaConfig, meta: Llama, file: Path) -> dict[str, str]:
    """Our parameter name -> the GGUF tensor name holding it (gguf's own name table)."""
    import gguf

    table = gguf.TensorNameMap(gguf.MODEL_ARCH[arch.upper()], config.num_layers)
    out = {}
    for name, _ in meta.named_parameters():
        base, _, suffix = hf_name(name).rpartition(".")
        mapped = table.get_name(base)
        if mapped is None:  # a bug in the table or the model, not the file
            raise RuntimeError(f"gguf has no tensor name for {hf_name(name)} ({arch})")
        out[name] = f"{mapped}.{suffix}"
    return out


def _unpermute(x: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of q / k rows (convert_hf_to_gguf's LlamaModel.permute): rows [N, ...]
    stored as (head, pair, half) back to (head, half, pair)."""
    n = x.shape[0]
    return x.reshape(heads, n // heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _q4_0_int4(raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 blocks [N, K / 32 * 18] -> (packed codes uint8 [N, K / 2], scales [N, K / 32, 2] float32): a block's
    byte j holds code j (low nibble) and j + 16 (high); w = (q - 8) * d, our (s, z) = (d, 0)."""
    blocks = np.ascontiguousarray(raw).reshape(n, k // 32, Q4_0_BLOCK)  # [N, G, 18]
    d = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)  # [N, G, 1]
    qs = blocks[:, :, 2:]  # [N, G, 16]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k)  # [N, K]
    scales = np.concatenate([d, np.zeros_like(d)], axis=-1)  # [N, G, 2]: (s, z)
    return pack_int4(torch.from_numpy(codes)), torch.from_numpy(scales)


def _floats(t: Any) -> torch.Tensor:
    """A tensor's values: F32 / F16 / BF16 as stored, any quantized type dequantized by gguf to float32."""
    from gguf.quants import dequantize

    kind = t.tensor_type.name
    if kind in ("F32", "F16"):
        return torch.from_numpy(np.array(t.data))
    if kind == "BF16":
        return torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(dequantize(t.data, t.tensor_type))


def load_gguf(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tp: TensorParallel = SINGLE,
    fused_projections: bool = True,
    quantize: Scheme | None = None,
) -> Llama:
    """The model of a GGUF file (see the module docstring). `dtype` defaults to the embedding's float type (float32
    for a quantized one); `quantize`: every tensor dequantized, then quantized by our scheme. Raises, naming the
    key or tensor and the file, before any tensor data is read."""
    file = Path(path)
    reader = open_gguf(file)
    arch = architecture(reader, file)
    config = gguf_config(reader, file)
    tp.check(config)
    device = torch.device(device if device is not None else "cpu")
    tensors = {t.name: t for t in reader.tensors}
    meta = Llama(config, dtype=torch.float32, device="meta", fused_projections=False)
    names = gguf_names(arch, config, meta, file)
    wanted = {names[n]: tuple(p.shape) for n, p in meta.named_parameters()}
    missing = [g for g in wanted if g not in tensors]
    if missing:
        raise KeyError(f"GGUF file {file} lacks tensor(s): {', '.join(missing)}")
    unexpected = [g for g in tensors if g not in wanted and g != ROPE_FREQS]  # rope_freqs: read into the config
    if unexpected:
        raise KeyError(f"GGUF file {file} has tensor(s) the model does not describe: {', '.join(unexpected)}")
    for g, shape in wanted.items():
        stored = tuple(int(x) for x in reversed(tensors[g].shape))  # GGUF lists dimensions innermost first
        if stored != shape:
            raise ValueError(f"tensor {g!r} in {file.name} has shape {stored}, the metadata needs {shape}")
    if dtype is None:
        dtype = FLOAT_TYPES.get(tensors["token_embd.weight"].tensor_type.name, torch.float32)
    plan = gguf_plan.plan(model_linears(meta, fused_projections), names, tensors, dtype, tp, quantize)
    if fused_projections and gguf_plan.mixed(model_linears(meta, True), names, plan):
        fused_projections = False  # one joined weight has one format
        plan = gguf_plan.plan(model_linears(meta, False), names, tensors, dtype, tp, quantize)

    gguf_plan.check_fits(file, plan, tensors, dtype, device)  # before any tensor is read

    heads = {"self_attn.q_proj": config.num_heads, "self_attn.k_proj": config.num_kv_heads}
    model = Llama(config, dtype=dtype, device="meta", tp=tp, fused_projections=fused_projections)
    codes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    blocks: dict[str, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for name, g in names.items():
        t = tensors[g]
        permuted = next((h for part, h in heads.items() if arch == "llama" and f".{part}." in f".{name}"), None)
        if g in plan.int4 or g in plan.blocks:
            raw = np.asarray(t.data).reshape(wanted[g][0], -1)  # [N, row bytes]
            raw = raw if permuted is None else _unpermute(raw, permuted)
            if g in plan.int4:
                codes[name] = tuple(x.to(device) for x in _q4_0_int4(raw, *wanted[g]))
            else:
                blocks[name] = torch.from_numpy(np.array(raw)).to(device)  # a copy: the file's map is dropped
            continue
        value = _floats(t)
        if permuted is not None:
            value = torch.from_numpy(_unpermute(value.float().numpy(), permuted)).to(value.dtype)
        state[name] = _slice(value, shard_dim(name), tp).to(device=device, dtype=dtype)
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        joined = getattr(module, "joined", None) or {}
        for child, linear in list(module.named_children()):
            parts = [prefix + p for p in (joined[child][0] if child in joined else (child,))]
            if isinstance(linear, nn.Linear) and f"{parts[0]}.weight" in codes:
                setattr(module, child, _int4_linear(codes, state, parts, linear.in_features))
            elif isinstance(linear, nn.Linear) and f"{parts[0]}.weight" in blocks:
                kind = plan.blocks[names[f"{parts[0]}.weight"]]
                setattr(module, child, _block_linear(blocks, state, parts, linear.in_features, kind, dtype))
    embed = names["embed_tokens.weight"]
    if embed in plan.blocks:
        model.embed_tokens = BlockEmbedding(BlockWeight(blocks.pop("embed_tokens.weight"), plan.blocks[embed],
                                                        config.hidden_size, dtype))
    join_projections(model, state)
    model.load_state_dict(state, strict=False, assign=True)
    model.reset_rope()
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left or codes or blocks:
        raise RuntimeError(f"GGUF load left {left} unset and {sorted(codes) + sorted(blocks)} unused")  # a bug
    in_blocks = {kind for g, kind in plan.blocks.items() if g != gguf_plan.EMBEDDING or config.tie_word_embeddings}
    if in_blocks:  # a projection (the tied head among them) multiplies blocks
        model.quantization = Blocks(tuple(sorted(in_blocks | ({"Q4_0"} if plan.int4 else set()))))
    elif plan.int4:
        model.quantization = INT4_EXACT
    gguf_plan.say(file, plan, dtype, quantize)
    if quantize is not None:
        quantize_model(model, quantize)
    to_huge_pages(model, files=[file])  # the file's page cache dropped first
    return model.eval().requires_grad_(False)


def _slice(value: torch.Tensor, dim: int | None, tp: TensorParallel) -> torch.Tensor:
    """This rank's slice of a whole tensor along `dim` (the whole tensor outside tensor parallelism)."""
    if dim is None or not tp.enabled:
        return value
    start, stop = tp.span(value.shape[dim])
    return value.narrow(dim, start, stop - start).contiguous()


def _int4_linear(codes: dict[str, tuple[torch.Tensor, torch.Tensor]], state: dict[str, torch.Tensor],
                 parts: list[str], in_features: int) -> QuantLinear:
    """A QuantLinear over the int4 codes and scales of `parts` (stacked by rows when joined), its bias float."""
    pieces = [codes.pop(f"{p}.weight") for p in parts]
    qweight = torch.cat([q for q, _ in pieces]) if len(pieces) > 1 else pieces[0][0]  # [N, K / 2]
    scales = torch.cat([s for _, s in pieces]) if len(pieces) > 1 else pieces[0][1]  # [N, K / 32, 2]
    biases = [state.pop(f"{p}.bias") for p in parts if f"{p}.bias" in state]
    bias = (torch.cat(biases) if len(biases) > 1 else biases[0]) if biases else None
    return QuantLinear.from_stored(QuantWeight.from_stored(qweight, scales, INT4_EXACT, in_features), bias)


def _block_linear(blocks: dict[str, torch.Tensor], state: dict[str, torch.Tensor], parts: list[str],
                  in_features: int, kind: str, dtype: torch.dtype) -> BlockLinear:
    """A BlockLinear over the blocks of `parts` (stacked by rows when joined: one type, `gguf_plan.mixed`), its
    bias float."""
    pieces = [blocks.pop(f"{p}.weight") for p in parts]
    rows = torch.cat(pieces) if len(pieces) > 1 else pieces[0]  # [N, row bytes]
    biases = [state.pop(f"{p}.bias") for p in parts if f"{p}.bias" in state]
    bias = (torch.cat(biases) if len(biases) > 1 else biases[0]) if biases else None
    return BlockLinear(BlockWeight(rows, kind, in_features, dtype), bias)
