"""Load a transformers `save_pretrained` directory: config.json, safetensors weights, tokenizer, EOS ids.

Weights are read with the `safetensors` library from `model.safetensors` or from the shards listed in
`model.safetensors.index.json`. Every tensor's name and shape is checked against the config before any data
is read, and errors name the key and the file. The model is built on the meta device and the loaded tensors
are assigned in place, so nothing is initialised twice.

Under tensor parallelism (`tp`) a rank reads only its slice of each split tensor (`safe_open(...).get_slice`
reads just those bytes of the memory-mapped file), so no rank ever materialises the whole model; replicated
tensors (embedding, norms, LM head, row-parallel biases) are read whole by every rank.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from static_decode.base.hugepages import to_huge_pages
from static_decode.checkpoints import quant_io
from static_decode.checkpoints.gguf import gguf_config, is_gguf, load_gguf, open_gguf
from static_decode.checkpoints.gguf_vocab import gguf_chat_template, gguf_tokenizer
from static_decode.checkpoints.sources import resolve_model
from static_decode.model.config import LlamaConfig, eos_ids
from static_decode.model.joining import join_projections
from static_decode.model.llama import Llama, hf_name
from static_decode.model.parallel import SINGLE, TensorParallel, joined_rows, shard_dim
from static_decode.model.quant import Scheme, parse, quantize_model
from static_decode.text import chat_template
from static_decode.text.chat_template import ChatTemplate

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Keys some checkpoints carry that hold nothing we need: rotary tables are recomputed from the config.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def default_model_path() -> Path:
    """The embedded default checkpoint shipped inside the package (static_decode/default_model)."""
    return Path(str(resources.files("static_decode") / "default_model"))


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from a dtype or its name ("bfloat16", "bf16", "float32", ...)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")


def _read_json(path: Path) -> dict:
    try:
        with path.open() as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def load_config(path: str | Path) -> LlamaConfig:
    """The model config of a checkpoint directory (EOS ids from generation_config.json when it has them), of a GGUF
    file (its metadata) or of a Hub id (static_decode.checkpoints.sources)."""
    root = resolve_model(path)
    if is_gguf(root):
        return gguf_config(open_gguf(root), root)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {root}")
    hf = _read_json(root / "config.json")
    config = _from_hf(hf, root / "config.json")
    gen_path = root / "generation_config.json"
    if gen_path.is_file():
        gen = _read_json(gen_path)
        if gen.get("eos_token_id") is not None:
            ids = eos_ids(gen["eos_token_id"], "generation_config.json key 'eos_token_id'")
            hf = {**hf, "eos_token_id": list(ids)}
            config = _from_hf(hf, root / "config.json")
    return config


def _from_hf(hf: dict, file: Path) -> LlamaConfig:
    """LlamaConfig.from_hf, its refusals (an unsupported rope type or key, a bad value) naming the file read."""
    try:
        return LlamaConfig.from_hf(hf)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{file}: {e}") from e


def _reason(error: BaseException) -> str:
    """The first line of an error from a file reader (the Rust readers' messages can run over several)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


@contextlib.contextmanager
def _open(file: Path) -> Iterator[Any]:
    """`safe_open(file)`, with a damaged file (truncated by an interrupted download or copy, or not safetensors at
    all) refused as a ValueError naming the file: the reader's own SafetensorError names neither file nor cause."""
    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"{file} is truncated or corrupt: {_reason(e)}") from e


def weight_files(root: Path) -> dict[str, Path]:
    """Map every stored tensor name to its safetensors file (from the index when sharded)."""
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' object")
        files = {key: root / name for key, name in weight_map.items()}
        for key, file in files.items():
            if not file.is_file():
                raise FileNotFoundError(f"{INDEX_FILE} maps {key!r} to {file.name}, which does not exist")
        return files
    single = root / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}")
    with _open(single) as f:
        return {key: single for key in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    tp: TensorParallel = SINGLE,
    fused_projections: bool = True,
    quantize: str | Scheme | None = None,
) -> Llama:
    """Load a Llama-family checkpoint: a directory written by transformers' save_pretrained, a GGUF file
    (static_decode.checkpoints.gguf) or a Hub id resolved in the local Hub cache (static_decode.checkpoints.sources).

    dtype defaults to the checkpoint's (that of its embedding); device defaults to the CPU. EOS ids land in
    `model.config.eos_token_ids`. With `tp`, the model is this rank's shard (see static_decode.model.parallel) and
    only its slices are read. `fused_projections`: q/k/v and gate/up joined into one weight each (Llama's
    default; see static_decode.model.joining). `quantize` ("int8", "int4", "int4-g64", ...): every
    projection and the LM head weight-only quantized once loaded (static_decode.model.quant); a checkpoint saved
    quantized (static_decode.checkpoints.quant_io) loads as it was saved, `quantize` its scheme or None. CPU weights end
    on transparent huge pages where Linux offers them (static_decode.base.hugepages). Raises, naming the key,
    on an unsupported architecture or rope type, a missing, unexpected or mis-shaped tensor, or a tensor-parallel
    world size that does not fit the model.
    """
    root = resolve_model(path)
    if not isinstance(tp, TensorParallel):
        raise TypeError(f"tp must be a static_decode.model.parallel.TensorParallel, got {type(tp).__name__}")
    if is_gguf(root):
        return load_gguf(root, dtype=parse_dtype(dtype), device=device, tp=tp, fused_projections=fused_projections,
                         quantize=parse(quantize))
    config = load_config(root)
    tp.check(config)  # before any tensor is read
    # a checkpoint saved quantized (static_decode.checkpoints.quant_io); None: float
    stored = quant_io.stored_quantization(root)
    if stored is not None:
        model = quant_io.load_quantized(root, config, stored, dtype=parse_dtype(dtype), device=device, tp=tp,
                                        fused_projections=fused_projections, quantize=parse(quantize))
        to_huge_pages(model, files=sorted(root.glob("*.safetensors")))  # their page cache dropped first
        return model
    files = weight_files(root)
    dtype = parse_dtype(dtype)
    scheme = parse(quantize)  # a bad name refused before any tensor is read
    device = torch.device(device if device is not None else "cpu")

    # Whole-model shapes in the checkpoint's layout (q/k/v and gate/up apart): what the files must hold.
    meta = Llama(config, dtype=torch.float32, device="meta", fused_projections=False)
    wanted = {hf_name(name): tuple(p.shape) for name, p in meta.named_parameters()}
    split = {hf_name(name): shard_dim(name) for name, _ in meta.named_parameters()}
    parts = stored_joined(meta)  # Phi3's qkv_proj / gate_up_proj: a rank reads its rows of each part
    missing = [k for k in wanted if k not in files]
    if missing:
        raise KeyError(f"checkpoint {root} lacks tensor(s): {', '.join(missing)}")
    unexpected = [
        k
        for k in files
        if k not in wanted
        and not k.endswith(IGNORED_SUFFIXES)
        # A tied checkpoint may still store the head; it is the embedding, so it is not needed.
        and not (k == "lm_head.weight" and config.tie_word_embeddings)
    ]
    if unexpected:
        raise KeyError(
            f"checkpoint {root} has tensor(s) the config does not describe: {', '.join(unexpected)}"
        )

    by_file: dict[Path, list[str]] = {}
    for key in wanted:
        by_file.setdefault(files[key], []).append(key)
    for file, keys in by_file.items():  # check every shape before reading any data
        with _open(file) as f:
            for key in keys:
                shape = tuple(f.get_slice(key).get_shape())
                if shape != wanted[key]:
                    raise ValueError(
                        f"tensor {key!r} in {file.name} has shape {shape}, the config needs {wanted[key]}"
                    )
    if dtype is None:
        with _open(files["model.embed_tokens.weight"]) as f:
            dtype = f.get_slice("model.embed_tokens.weight").get_dtype()
            dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(dtype)
        if dtype is None:
            raise ValueError("the checkpoint's embedding dtype is not a float type; pass dtype=")

    tensors: dict[str, torch.Tensor] = {}
    for file, keys in by_file.items():
        with _open(file) as f:
            for key in keys:
                tensors[key] = _read(f, key, split[key], wanted[key], tp, parts.get(key)).to(device=device, dtype=dtype)
    model = Llama(config, dtype=dtype, device="meta", tp=tp, fused_projections=fused_projections)
    state = {name: tensors.pop(hf_name(name)) for name, _ in meta.named_parameters()}
    # q/k/v and gate/up joined here, once, each layer's parts freed as it goes; under tp from this rank's slices.
    join_projections(model, state)
    model.load_state_dict(state, strict=True, assign=True)
    model.reset_rope()
    if scheme is not None:  # after slicing: a rank quantizes its own slices (static_decode.model.quant)
        quantize_model(model, scheme)
    # CPU weights onto transparent huge pages (a decode step streams them), the files' page cache dropped first
    to_huge_pages(model, files=sorted(set(files.values())))
    return model.eval().requires_grad_(False)


def stored_joined(meta: Llama) -> dict[str, tuple[int, ...]]:
    """The checkpoint keys of joined projections stored joined (Phi3's qkv_proj, gate_up_proj) -> their parts'
    rows in order (q, k, v; gate, up), from a whole (world 1) model."""
    if not meta.config.joined_checkpoint:
        return {}
    out: dict[str, tuple[int, ...]] = {}
    for i, block in enumerate(meta.layers):
        a, m = block.self_attn, block.mlp
        for suffix in ("weight", "bias"):
            out[hf_name(f"layers.{i}.self_attn.qkv_proj.{suffix}")] = tuple(a.sizes)
            out[hf_name(f"layers.{i}.mlp.gate_up_proj.{suffix}")] = (m.inner, m.inner)
    return out


def _read(
    f, key: str, dim: int | None, shape: tuple[int, ...], tp: TensorParallel, parts: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Tensor `key` of an open safetensors file, or only this rank's slice along `dim` of it; `parts`: the rows of
    the parts of a tensor stored joined (q, k, v), each sliced apart and the slices joined."""
    if dim is None or not tp.enabled:
        return f.get_tensor(key)
    if parts is not None:
        part = f.get_slice(key)
        return torch.cat([part[start:stop] for start, stop in joined_rows(parts, tp)])  # [sum(rows) / world, ...]
    start, stop = tp.span(shape[dim])
    part = f.get_slice(key)
    return part[start:stop] if dim == 0 else part[:, start:stop]


def load_tokenizer(path: str | Path):  # -> tokenizers.Tokenizer | None
    """The `tokenizers` Tokenizer of a checkpoint directory (None when it has no tokenizer.json), of a GGUF file (from
    its metadata: static_decode.checkpoints.gguf_vocab) or of a Hub id.

    A tokenizer.json that `tokenizers` cannot parse raises ValueError naming the file and the reason.
    """
    root = resolve_model(path)
    if is_gguf(root):
        return gguf_tokenizer(root)
    file = root / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for bad JSON or an unknown model layout
        raise ValueError(f"{file} is not a valid tokenizer file: {_reason(e)}") from e


def load_chat_template(path: str | Path) -> ChatTemplate | None:
    """The chat template of a checkpoint directory (static_decode.text.chat_template), of a GGUF file (its
    `tokenizer.chat_template`) or of a Hub id; None when it has none."""
    root = resolve_model(path)
    return gguf_chat_template(root) if is_gguf(root) else chat_template.load_chat_template(root)
