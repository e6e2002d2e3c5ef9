"""Quantized checkpoints: a model quantized once (static_decode.model.quant), saved, and loaded back without quantizing.

A saved quantized checkpoint loads in the time its bytes take to read, with no range search. `save_quantized` writes
`quantized.safetensors` (not model.safetensors, so transformers finds no weights rather than wrong ones), the
config.json with a `quantization` entry, and the float checkpoint's other files. `load_quantized` checks every
name, shape and dtype before reading data, so the model equals the one saved, to the bit; a tensor-parallel rank
reads only its slices. The layout in full: docs/internals.md#quant-io.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from static_decode.model.config import LlamaConfig
from static_decode.model.gguf_dequant import BLOCK_TYPES
from static_decode.model.gguf_quant import BlockLinear, Blocks, BlockWeight, block_types
from static_decode.model.gguf_quantize import quant_refusal
from static_decode.model.llama import Llama, hf_name
from static_decode.model.parallel import SINGLE, TensorParallel, shard_dim
from static_decode.model.quant import (
    DTYPES,
    INT4_CHUNK,
    QuantLinear,
    QuantWeight,
    Scheme,
    int4_refusal,
    parse,
    scheme_of,
)

FORMAT = "static-decode"
WEIGHTS_FILE = "quantized.safetensors"
ENTRY = "quantization"  # the config.json key
# The stored layout of each width and its version (bumped when the bytes a reader expects change).
LAYOUTS = {8: ("int8-rows", 1), 4: ("int4-chunk64", 1), 0: ("gguf-blocks", 1)}  # 0: GGUF blocks (Blocks)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int8: "I8", torch.uint8: "U8"}
# Files of a checkpoint directory that hold weights (not copied beside the quantized ones).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclasses.dataclass(frozen=True)
class Quantized:
    """What a quantized checkpoint's config.json says of it: the scheme and the model dtype its scales are in."""

    scheme: Scheme | Blocks
    dtype: torch.dtype

    def entry(self) -> dict[str, Any]:
        layout, version = LAYOUTS[self.scheme.bits]
        name = self.scheme.spec if isinstance(self.scheme, Blocks) else self.scheme.name
        return {"format": FORMAT, "scheme": name, "bits": self.scheme.bits, "group": self.scheme.group,
                "layout": layout, "layout_version": version, "dtype": DTYPE_NAMES[self.dtype]}

    @classmethod
    def from_entry(cls, entry: Any, where: Path) -> Quantized:
        """The entry read back, every key checked; errors name the file and the key."""
        what = f"{where} key '{ENTRY}'"
        if not isinstance(entry, dict):
            raise ValueError(f"{what} must be an object, got {type(entry).__name__}")
        if entry.get("format") != FORMAT:
            raise ValueError(f"{what}: format {entry.get('format')!r} is not {FORMAT!r}")
        try:
            scheme = parse(entry.get("scheme"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what}: scheme: {e}") from e
        if scheme is None or (entry.get("bits"), entry.get("group")) != (scheme.bits, scheme.group):
            raise ValueError(f"{what}: scheme {entry.get('scheme')!r} with bits {entry.get('bits')!r} and group "
                             f"{entry.get('group')!r} is not a quantization scheme")
        layout = (entry.get("layout"), entry.get("layout_version"))
        if layout != LAYOUTS[scheme.bits]:
            raise ValueError(f"{what}: layout {layout[0]!r} version {layout[1]!r}; this static-decode reads "
                             f"{scheme.name} as {LAYOUTS[scheme.bits][0]!r} version {LAYOUTS[scheme.bits][1]}: "
                             "quantize the float checkpoint again")
        dtype = {name: d for d, name in DTYPE_NAMES.items()}.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"{what}: dtype {entry.get('dtype')!r}; one of {', '.join(DTYPE_NAMES.values())}")
        return cls(scheme, dtype)


def stored_quantization(root: Path) -> Quantized | None:
    """The quantization of the checkpoint at `root` (None: a float checkpoint, config.json without the entry)."""
    file = Path(root) / "config.json"
    hf = json.loads(file.read_text())
    return None if not isinstance(hf, dict) or ENTRY not in hf else Quantized.from_entry(hf[ENTRY], file)


# ---- what the file holds -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Tensor:
    """A stored tensor: its whole shape and dtype, the dimension a rank slices (None: read whole) and, for a
    projection's codes and scales, how (`kind`: "qweight" / "scales"; `linear` its in_features K)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int | None
    kind: str = "float"
    linear: int = 0


def stored_name(linear: str, suffix: str) -> str:
    """The stored name of tensor `suffix` ("qweight", "scales", "bias") of our projection `linear`."""
    return hf_name(f"{linear}.{suffix}")


def _quant_tensors(linear: str, N: int, K: int, q: Quantized, dim: int | None) -> dict[str, _Tensor]:
    """The codes and scales of our projection `linear` ([N, K]) under scheme q.scheme; GGUF blocks' bytes."""
    s = q.scheme
    if isinstance(s, Blocks):
        t = BLOCK_TYPES[s.types[0]]
        if why := quant_refusal(K, s.types[0]):
            raise ValueError(f"{stored_name(linear, 'blocks')}: {why}")
        return {stored_name(linear, "blocks"): _Tensor((N, K // t.weights * t.bytes), torch.uint8, dim, "blocks", K)}
    if s.bits == 4 and (why := int4_refusal(K, s.group)):  # the config describes weights the layout cannot hold
        raise ValueError(f"{stored_name(linear, 'qweight')}: {why}")
    if s.bits == 8:
        return {stored_name(linear, "qweight"): _Tensor((N, K), torch.int8, dim, "qweight", K),
                stored_name(linear, "scales"): _Tensor((N,), q.dtype, dim, "scales", K)}
    return {stored_name(linear, "qweight"): _Tensor((N, K // 2), torch.uint8, dim, "qweight", K),
            stored_name(linear, "scales"): _Tensor((N, K // s.group, 2), q.dtype, dim, "scales", K)}


def expected_tensors(config: LlamaConfig, q: Quantized) -> dict[str, _Tensor]:
    """Every tensor a quantized checkpoint of `config` holds, by its stored name (the whole model's shapes)."""
    meta = Llama(config, dtype=torch.float32, device="meta", fused_projections=False)  # the checkpoint's layout
    out: dict[str, _Tensor] = {}
    for name, module in meta.named_modules():
        prefix = f"{name}." if name else ""
        for pname, p in module.named_parameters(recurse=False):
            full = prefix + pname
            if isinstance(module, nn.Linear) and pname == "weight":
                out.update(_quant_tensors(name, *p.shape, q, shard_dim(full)))
            else:
                out[hf_name(full)] = _Tensor(tuple(p.shape), q.dtype, shard_dim(full))
    if config.tie_word_embeddings:  # the head's own quantized copy of the embedding
        out.update(_quant_tensors("lm_head", config.vocab_size, config.hidden_size, q, None))
    return out


def _index(key: str, t: _Tensor, q: Quantized, tp: TensorParallel) -> tuple[slice, ...] | None:
    """The part of stored tensor `key` this rank reads (None: all of it)."""
    if t.dim is None or not tp.enabled:
        return None
    if t.dim == 0:  # column-parallel: rows of the codes, scales and bias alike
        return (slice(*tp.span(t.shape[0])),)
    K, s = t.linear, q.scheme
    if isinstance(s, Blocks):
        raise ValueError(f"{key}: a checkpoint of GGUF blocks ({s.spec}) loads in one process; tensor parallelism "
                         "takes int8 or int4 checkpoints")
    start, stop = tp.span(K)  # this rank's inputs of a row-parallel projection
    if s.bits == 8:  # codes column by column; every rank keeps the whole rows' scales
        return (slice(None), slice(start, stop)) if t.kind == "qweight" else None
    if (stop - start) % INT4_CHUNK or (stop - start) % s.group:
        raise ValueError(f"tensor-parallel world size {tp.world} gives each rank {stop - start} of {key}'s {K} "
                         f"inputs, not whole int4 chunks of {INT4_CHUNK} columns and groups of {s.group}: use a "
                         "smaller world size, or an int8 checkpoint")
    if t.kind == "qweight":  # two columns a byte, in whole chunks
        return (slice(None), slice(start // 2, stop // 2))
    return (slice(None), slice(start // s.group, stop // s.group))


def _reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


@contextlib.contextmanager
def _open(file: Path) -> Iterator[Any]:
    """`safe_open(file)`, a damaged file refused as a ValueError naming it (as static_decode.checkpoints.loading
    does)."""
    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"{file} is truncated or corrupt: {_reason(e)}") from e


def _read_all(root: Path, config: LlamaConfig, q: Quantized, tp: TensorParallel,
              device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's part of every stored tensor, each name, shape and dtype checked before any data is read."""
    file = root / WEIGHTS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in {root} (its config.json says it is quantized)")
    wanted = expected_tensors(config, q)
    with _open(file) as f:
        stored = set(f.keys())
        missing = [k for k in wanted if k not in stored]
        if missing:
            raise KeyError(f"quantized checkpoint {root} lacks tensor(s): {', '.join(missing)}")
        unexpected = sorted(stored - set(wanted))
        if unexpected:
            raise KeyError(f"quantized checkpoint {root} has tensor(s) the config does not describe: "
                           f"{', '.join(unexpected)}")
        index = {}
        for key, t in wanted.items():
            part = f.get_slice(key)
            shape, dtype = tuple(part.get_shape()), part.get_dtype()
            if (shape, dtype) != (t.shape, SAFETENSORS_DTYPES[t.dtype]):
                raise ValueError(f"tensor {key!r} in {file.name} is {dtype} {shape}, the config and the "
                                 f"{q.scheme.name} {DTYPE_NAMES[q.dtype]} layout need "
                                 f"{SAFETENSORS_DTYPES[t.dtype]} {t.shape}")
            index[key] = _index(key, t, q, tp)
        tensors = {}
        for key, t in wanted.items():
            try:
                value = f.get_tensor(key) if index[key] is None else f.get_slice(key)[index[key]]
            except SafetensorError as e:
                raise ValueError(f"tensor {key!r} in {file} cannot be read: {_reason(e)}") from e
            if t.kind == "scales" and not torch.isfinite(value).all():
                raise ValueError(f"tensor {key!r} in {file} holds non-finite scales: the file is corrupt")
            tensors[key] = value.contiguous().to(device)
    return tensors


# ---- loading ---------------------------------------------------------------------------------------------------
def load_quantized(
    root: str | Path,
    config: LlamaConfig,
    stored: Quantized,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tp: TensorParallel = SINGLE,
    fused_projections: bool = True,
    quantize: Scheme | Blocks | None = None,
) -> Llama:
    """The model of a quantized checkpoint (`stored`: its config.json's entry), built from its stored tensors.

    `dtype` must be the one it was quantized for (or None); `quantize` its scheme (or None). Under `tp` this rank's
    shard, read as its slices (see the module docstring)."""
    root = Path(root)
    where = f"{root} is quantized as {stored.scheme.name} for {DTYPE_NAMES[stored.dtype]}"
    if quantize is not None and quantize != stored.scheme:
        raise ValueError(f"{where}; --quantize {quantize.name} needs the float checkpoint (quantize it at load, or "
                         "save it again with static-decode quantize)")
    if dtype is not None and dtype != stored.dtype:
        raise ValueError(f"{where} (its scales are rounded to it); --dtype {str(dtype).removeprefix('torch.')} "
                         "needs the float checkpoint quantized in that dtype")
    device = torch.device(device if device is not None else "cpu")
    if device.type not in ("cpu", "cuda"):  # where the products run (static_decode.model.quant)
        raise ValueError(f"{where}: its products run on the CPU or CUDA, not {device}")
    tensors = _read_all(root, config, stored, tp, device)
    model = Llama(config, dtype=stored.dtype, device="meta", tp=tp, fused_projections=fused_projections)
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        joined = getattr(module, "joined", None) or {}
        for child, linear in list(module.named_children()):
            if not isinstance(linear, nn.Linear):
                continue
            parts = [prefix + p for p in (joined[child][0] if child in joined else (child,))]
            setattr(module, child, _linear(tensors, parts, stored.scheme, linear.in_features, linear.bias is not None,
                                           stored.dtype))
    if model.lm_head is None:  # tied: the head's own quantized copy
        model.lm_head = _linear(tensors, ["lm_head"], stored.scheme, config.hidden_size, False, stored.dtype)
    floats = {name: tensors.pop(hf_name(name)) for name, p in model.named_parameters() if p.is_meta}
    model.load_state_dict(floats, strict=False, assign=True)
    model.reset_rope()
    left = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left or tensors:
        raise RuntimeError(f"quantized load left {left} unset and {sorted(tensors)} unused")  # a bug, not the file
    model.quantization = stored.scheme
    return model.eval().requires_grad_(False)


def _linear(tensors: dict[str, torch.Tensor], parts: list[str], scheme: Scheme | Blocks, in_features: int,
            bias: bool, dtype: torch.dtype) -> QuantLinear | BlockLinear:
    """A QuantLinear (BlockLinear) over the stored tensors of projections `parts` (our names: one projection, or
    those a joined one stacks by rows), popped from `tensors`."""

    def rows(suffix: str) -> torch.Tensor:
        pieces = [tensors.pop(stored_name(p, suffix)) for p in parts]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # [sum(rows), ...]

    if isinstance(scheme, Blocks):
        blocks = BlockWeight(rows("blocks"), scheme.types[0], in_features, dtype)
        return BlockLinear(blocks, rows("bias") if bias else None)
    weight = QuantWeight.from_stored(rows("qweight"), rows("scales"), scheme, in_features)
    return QuantLinear.from_stored(weight, rows("bias") if bias else None)


# ---- saving ----------------------------------------------------------------------------------------------------
def checkpoint_tensors(model: Llama) -> dict[str, torch.Tensor]:
    """A quantized model's tensors under the stored names (joined projections split into their parts), on the
    CPU, each its own copy (safetensors stores no views of one another)."""
    scheme = scheme_of(model)
    if scheme is None:
        raise ValueError("the model is not quantized: quantize it first (static_decode.model.quant.quantize_model)")
    kinds = block_types(model)
    from_file = isinstance(model.embed_tokens.weight, BlockWeight)
    if kinds and (not isinstance(scheme, Blocks) or len(kinds) > 1 or from_file):
        raise ValueError(f"the model holds GGUF blocks ({', '.join(sorted(kinds))}) as a GGUF file does (several "
                         "types, or its embedding): load the GGUF file itself; a checkpoint holds one type, quantized "
                         "from a float one (static-decode quantize --quantize q4_k)")
    if model.tp.enabled:
        raise ValueError(f"the model is the shard of {model.tp.describe()}: save a quantized checkpoint from a "
                         "single process")
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            raise ValueError(f"{name} is not quantized: every projection of a quantized checkpoint is")
        if isinstance(module, (QuantWeight, BlockWeight)):
            same = module.scheme == scheme if isinstance(module, QuantWeight) else (module.scheme.name,) == scheme.types
            if not same:
                raise ValueError(f"{name} is {module.scheme.name}, the model {scheme.name}: a checkpoint holds one")
            continue
        if not isinstance(module, (QuantLinear, BlockLinear)):
            prefix = f"{name}." if name else ""
            out.update({hf_name(prefix + p): t for p, t in module.named_parameters(recurse=False)})
            continue
        parent, _, child = name.rpartition(".")
        joined = getattr(model.get_submodule(parent), "joined", None) or {}
        parts, sizes = joined.get(child, ((child,), (module.out_features,)))
        w, prefix = module.weight, f"{parent}." if parent else ""
        stored = ((("blocks", w.blocks),) if isinstance(w, BlockWeight) else (("qweight", w.qweight),
                                                                             ("scales", w.scales)))
        for suffix, whole in (*stored, ("bias", module.bias)):
            if whole is not None:
                for part, piece in zip(parts, whole.split(list(sizes)), strict=True):
                    out[stored_name(prefix + part, suffix)] = piece
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in out.items()}


@dataclasses.dataclass(frozen=True)
class Saved:
    """What `save_quantized` wrote: the directory, the weights file's bytes and the files copied beside it."""

    out: Path
    weight_bytes: int
    copied: tuple[str, ...]


def save_quantized(model: Llama, out: str | Path, source: str | Path) -> Saved:
    """Write quantized `model` (loaded from the float checkpoint `source`) to the new directory `out`: the weights
    file, the tokenizer and other files of `source` but its weights, and config.json with the quantization entry
    (written last: a directory cut short by an error holds no config.json, so nothing takes it for a checkpoint).
    `out` must not exist or be empty."""
    out, source = Path(out), Path(source)
    hf = json.loads((source / "config.json").read_text())
    if not isinstance(hf, dict):
        raise ValueError(f"{source / 'config.json'} must hold a JSON object")
    if ENTRY in hf:
        raise ValueError(f"{source} is a quantized checkpoint already; quantize its float checkpoint")
    described = dataclasses.replace(LlamaConfig.from_hf(hf), eos_token_ids=model.config.eos_token_ids)
    if described != model.config:
        raise ValueError(f"{source / 'config.json'} does not describe this model")
    if model.dtype not in DTYPES:
        raise ValueError(f"a quantized checkpoint holds a float32 or bfloat16 model, not {model.dtype}")
    tensors = checkpoint_tensors(model)  # before anything is written: a refusal leaves no directory behind
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty directory; choose a new one")
    q = Quantized(scheme_of(model), model.dtype)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{WEIGHTS_FILE}.partial"
    save_file(tensors, str(tmp), metadata={"format": "pt", ENTRY: json.dumps(q.entry())})
    shutil.copymode(source / "config.json", tmp)  # the checkpoint's permissions (the writer makes it private)
    os.replace(tmp, out / WEIGHTS_FILE)
    copied = []
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name != "config.json" and not f.name.endswith(WEIGHT_SUFFIXES) \
                and f.name not in WEIGHT_INDEXES:
            shutil.copy2(f, out / f.name)
            copied.append(f.name)
    hf[ENTRY] = q.entry()
    hf["dtype"] = DTYPE_NAMES[model.dtype]  # the weights' dtype as transformers 5.x names it (4.x: torch_dtype)
    if "torch_dtype" in hf:
        hf["torch_dtype"] = hf["dtype"]
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return Saved(out, (out / WEIGHTS_FILE).stat().st_size, tuple(copied))
