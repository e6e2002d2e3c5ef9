"""Decode ms/token of a model in float and quantized forms (and llama.cpp GGUFs), requests taking turns.

    OMP_NUM_THREADS=1 python profiles/quant_decode.py --model DIR [--forms bfloat16,bfloat16:int8,bfloat16:int4]
        [--gguf Q8_0=FILE,Q4_0=FILE] [--contexts 128,1024] [--steps 32] [--repeats 5] [--json PATH]

Each form is DTYPE or DTYPE:QUANTIZE, run as the bench's `static-decode` system (a compiled Generator, the CPU
default settings: layer regions, and the fused decode layers where they take the model); each GGUF as the bench's
`llama.cpp` system. Every system's requests take turns with the others' and over the contexts
(static_decode.commands.bench.timing.time_interleaved), so a slow phase of the shared machine falls on all alike;
medians over the repeats. The prompt is Python's argparse.py source.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from static_decode.checkpoints.loading import load_model, load_tokenizer
from static_decode.commands.bench.systems import GeneratorSystem, LlamaCppSystem
from static_decode.commands.bench.timing import time_interleaved
from static_decode.model.quant import weight_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--forms", default="bfloat16,bfloat16:int8,bfloat16:int4")
    p.add_argument("--gguf", default="", help="NAME=FILE,... llama.cpp systems")
    p.add_argument("--contexts", default="128,1024")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    max_len = max(contexts) + args.steps + 8
    ids = load_tokenizer(args.model).encode(Path(argparse.__file__).read_text(), add_special_tokens=False).ids
    prompts = {L: ids[:L] for L in contexts}
    systems, facts = [], {}
    for form in args.forms.split(","):
        dtype, _, q = form.partition(":")
        t0 = time.perf_counter()
        model = load_model(args.model, dtype=dtype, quantize=q or None)
        s = GeneratorSystem("static-decode", model, max_len)
        s.name = f"static-decode {form}"
        facts[s.name] = {"weight_mb": round(weight_bytes(model) / 1e6, 1), "setup_s": round(time.perf_counter() - t0),
                         "mode": s.mode, "fused": s.gen.runner.regions.fused is not None}
        print(s.name, facts[s.name], flush=True)
        systems.append(s)
    for item in filter(None, args.gguf.split(",")):
        name, _, file = item.partition("=")
        s = LlamaCppSystem(Path(file), max_len, torch.get_num_threads())
        s.name = f"llama.cpp {name}"
        facts[s.name] = {"weight_mb": round(Path(file).stat().st_size / 1e6, 1), "mode": s.mode}
        print(s.name, facts[s.name], flush=True)
        systems.append(s)
    timings = time_interleaved(systems, prompts, args.steps, repeats=args.repeats, warmup=args.warmup)
    rows = []
    for L in contexts:
        for s in systems:
            t = timings[L][s.name]
            rows.append({"system": s.name, "context": L, "ms_per_token": round(t.ms_per_token(), 2),
                         "ms_per_token_best": round(t.ms_per_token(min), 2), "tokens": t.tokens[:8]})
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "steps": args.steps,
                                         "repeats": args.repeats, "systems": facts, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
