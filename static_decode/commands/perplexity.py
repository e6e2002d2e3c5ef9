"""`static-decode perplexity`: how well a model (float or quantized) predicts a text, through the chunked prefill.

The text's first `--tokens` tokens go through the model in `--chunk`-token chunks over one static cache, each
chunk written at the cache's length and attending to everything before it (the offset mask), exactly the path a
long prompt's prefill takes; every position's logits score the next token. Perplexity = exp(mean negative
log-likelihood) over the tokens - 1 predictions. Comparable across dtypes and quantizations of one model (the
same tokens, the same chunks), and with llama.cpp's `perplexity` over the same tokens.

The default text (static_decode/texts/perplexity.txt) is an essay written for this package (plain English prose
about measuring things, ~1,200 SmolLM2 tokens), shipped so the command needs no download.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from static_decode.base.progress import progress_bar
from static_decode.checkpoints.loading import default_model_path, load_model, load_tokenizer
from static_decode.commands.args import add_threads_argument, apply_threads, check_device
from static_decode.model.llama import Llama
from static_decode.model.quant import scheme_of

DEFAULT_TOKENS = 1024
DEFAULT_CHUNK = 256


def default_text_path() -> Path:
    return Path(str(resources.files("static_decode") / "texts" / "perplexity.txt"))


@dataclass(frozen=True)
class Perplexity:
    """The result: perplexity over `tokens` - 1 predictions, their mean NLL (nats) and the tokens per second of the
    chunked forward passes."""

    perplexity: float
    nll: float
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def perplexity(model: Llama, ids: list[int], chunk: int, *, progress: bool = False) -> Perplexity:
    """Perplexity of token ids `ids` (at least 2) under `model`, fed in chunks of `chunk` through one cache."""
    if len(ids) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {len(ids)}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    tokens = torch.tensor(ids, dtype=torch.int64, device=model.device)  # [N]
    N = tokens.numel()
    cache = model.new_cache(1, N)
    total = 0.0
    start = time.perf_counter()
    with torch.inference_mode(), progress_bar("perplexity", N, enabled=progress) as advance:
        for lo in range(0, N, chunk):
            part = tokens[lo:lo + chunk]  # [T]
            logits = model(part[None], cache, [part.numel()])[0]  # [T, V]: the chunk at the cache's length
            targets = tokens[lo + 1:lo + chunk + 1]  # [T or T - 1]: the last chunk has no next token for its end
            logp = torch.log_softmax(logits[: targets.numel()].float(), dim=-1)  # [T', V]
            total -= float(logp.gather(1, targets[:, None]).sum())
            seconds = time.perf_counter() - start
            advance(f"{lo + part.numel()} tokens, {(lo + part.numel()) / seconds:.0f} tok/s, "
                    f"ppl {math.exp(total / max(lo + part.numel() - 1, 1)):.3f}", part.numel())
    seconds = time.perf_counter() - start
    nll = total / (N - 1)
    return Perplexity(math.exp(nll), nll, N, seconds)


def run(args: argparse.Namespace) -> int:
    if args.tokens < 2:
        raise ValueError(f"--tokens must be at least 2, got {args.tokens}")
    if args.chunk < 1:
        raise ValueError(f"--chunk must be at least 1, got {args.chunk}")
    apply_threads(args)
    device = check_device(args.device)
    path = args.model if args.model is not None else default_model_path()
    text_path = args.text if args.text is not None else default_text_path()
    if not text_path.is_file():
        raise FileNotFoundError(f"no text file {text_path} (--text)")
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"{path} has no tokenizer.json; perplexity needs the model's tokenizer")
    ids = tokenizer.encode(text_path.read_text(encoding="utf-8"), add_special_tokens=False).ids[: args.tokens]
    if len(ids) < args.tokens:
        print(f"note: {text_path.name} has {len(ids)} tokens, fewer than --tokens {args.tokens}", file=sys.stderr)
    t0 = time.perf_counter()
    model = load_model(path, dtype=args.dtype, device=device, quantize=args.quantize)  # or a saved quantized one
    model.kv_dtype = args.kv_dtype  # None: the model's dtype
    load_s = time.perf_counter() - t0
    result = perplexity(model, ids, args.chunk, progress=not args.quiet)
    scheme = scheme_of(model)
    what = f"{str(model.dtype).removeprefix('torch.')}" + (f" {scheme.name}" if scheme else "")
    what += f", {str(model.kv_dtype).removeprefix('torch.')} cache" if model.kv_dtype != model.dtype else ""
    print(f"perplexity {result.perplexity:.4f} ({what}; {result.tokens} tokens of {text_path.name} in chunks of "
          f"{args.chunk}; {result.tokens_per_s:.0f} tokens/s; loaded in {load_s:.1f} s)")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from static_decode.model.quant import CHOICES

    p = subparsers.add_parser("perplexity", help="perplexity of a text through the chunked prefill",
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint dir, .gguf file or Hub id org/name[@revision] (default: embedded model)")
    p.add_argument("--quantize", default=None, choices=CHOICES, help="weight-only quantization of the projections")
    p.add_argument("--text", type=Path, default=None, help="a UTF-8 text file (default: the shipped essay)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="score the first N tokens of the text")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="tokens per prefill chunk")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--kv-dtype", default=None, choices=("float32", "bfloat16", "float16", "int8"),
                   help="the K/V cache's dtype (default: the model's); every chunk attends through the cache")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    add_threads_argument(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)
