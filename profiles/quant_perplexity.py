"""Perplexity of a model in float and quantized forms on one text, side by side (the `perplexity` command's path).

    python profiles/quant_perplexity.py --model DIR [--text FILE] [--tokens 1024] [--chunk 256]
        [--forms float32,bfloat16,float32:int8,bfloat16:int8,float32:int4-g32,...] [--json PATH]

Default text: Python's own argparse.py source (the first 1,024 tokens, 256-token chunks: the comparison llama.cpp's
`perplexity` was run on). Each form is DTYPE or DTYPE:QUANTIZE; it prints perplexity, its rise over the same dtype's
float model, the bytes of the weights (static_decode.model.quant.weight_bytes) and the load (with quantization) seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from static_decode.checkpoints.loading import load_model, load_tokenizer
from static_decode.commands.perplexity import perplexity
from static_decode.model.quant import weight_bytes

FORMS = ("float32,bfloat16,float32:int8,bfloat16:int8,float32:int4-g32,bfloat16:int4-g32,float32:int4-g64,"
         "bfloat16:int4-g64")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--text", type=Path, default=Path(argparse.__file__))
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--forms", default=FORMS)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    ids = load_tokenizer(args.model).encode(args.text.read_text(), add_special_tokens=False).ids[: args.tokens]
    rows, base = [], {}
    for form in args.forms.split(","):
        dtype, _, q = form.partition(":")
        t0 = time.perf_counter()
        model = load_model(args.model, dtype=dtype, quantize=q or None)
        load_s = time.perf_counter() - t0
        r = perplexity(model, ids, args.chunk)
        if not q:
            base[dtype] = r.perplexity
        rise = r.perplexity - base[dtype] if dtype in base else float("nan")
        row = {"dtype": dtype, "quantize": q or None, "perplexity": round(r.perplexity, 4), "rise": round(rise, 4),
               "weight_mb": round(weight_bytes(model) / 1e6, 1), "tokens_per_s": round(r.tokens_per_s, 1),
               "load_s": round(load_s, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model
    if args.json:
        args.json.write_text(json.dumps({"text": str(args.text), "tokens": len(ids), "chunk": args.chunk,
                                         "threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
