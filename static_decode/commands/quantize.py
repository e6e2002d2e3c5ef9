"""`static-decode quantize`: quantize a float checkpoint once and save it (static_decode.checkpoints.quant_io), so that
every command takes the saved directory as `--model` and loads it without quantizing again.

    static-decode quantize --model DIR --quantize int4 --out DIR2 [--dtype bfloat16] [-t N]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from static_decode.checkpoints.gguf import is_gguf
from static_decode.checkpoints.loading import default_model_path, load_model
from static_decode.checkpoints.quant_io import WEIGHT_SUFFIXES, WEIGHTS_FILE, save_quantized, stored_quantization
from static_decode.commands.args import add_threads_argument, apply_threads, check_checkpoint
from static_decode.model.quant import LOAD_CHOICES, quantize_model, weight_bytes

MB = 1e6


def run(args: argparse.Namespace) -> int:
    apply_threads(args)
    path = args.model if args.model is not None else default_model_path()
    path = check_checkpoint(path)
    if is_gguf(path):  # a quantized checkpoint keeps the float checkpoint's config.json and tokenizer files
        raise ValueError(f"quantize saves a checkpoint directory beside a float one; {path} is a GGUF file: load it "
                         "with --quantize int8 / int4 instead, or quantize its save_pretrained directory")
    stored = stored_quantization(path)
    if stored is not None:  # before anything is loaded
        raise ValueError(f"{path} is quantized already ({stored.scheme.name}); quantize its float checkpoint")
    out: Path = args.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty directory; choose a new one")
    t0 = time.perf_counter()
    model = load_model(path, dtype=args.dtype)
    float_bytes = weight_bytes(model)
    t1 = time.perf_counter()
    quantize_model(model, args.quantize)
    t2 = time.perf_counter()
    saved = save_quantized(model, out, path)
    t3 = time.perf_counter()
    on_disk = sum(f.stat().st_size for f in path.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))
    dtype = str(model.dtype).removeprefix("torch.")
    print(f"quantized {path} ({dtype}) as {model.quantization.name} in {t3 - t0:.1f} s: load {t1 - t0:.1f} s, "
          f"quantize {t2 - t1:.1f} s, write {t3 - t2:.1f} s")
    print(f"weights: {saved.weight_bytes / MB:.1f} MB in {out / WEIGHTS_FILE} (the float checkpoint's: "
          f"{on_disk / MB:.1f} MB on disk, {float_bytes / MB:.1f} MB as {dtype})")
    print(f"wrote {out}: {', '.join([WEIGHTS_FILE, 'config.json', *saved.copied])}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("quantize", help="quantize a checkpoint once and save it",
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None,
                   help="float checkpoint dir or Hub id org/name[@revision] (default: embedded model)")
    p.add_argument("--quantize", required=True, choices=LOAD_CHOICES,
                   help="int8 (per output channel), int4 (groups of 32; int4-g64 / int4-g128), or llama.cpp's blocks "
                   "q4_k / q5_k / q6_k / q8_0")
    p.add_argument("--out", type=Path, required=True, help="the new checkpoint dir (must not exist, or be empty)")
    p.add_argument("--dtype", default=None,
                   help="float32 or bfloat16: the model dtype the scales are rounded to and every command then runs "
                   "(default: the checkpoint's)")
    add_threads_argument(p)
    p.set_defaults(run=run)
