"""Joined q/k/v and gate/up projections against separate ones, side by side in one process, on a real checkpoint.

    python profiles/fused_projections_ab.py --model DIR [--dtype bfloat16] [--contexts 128,1024] [--rounds 6]
                                            [--threads 2] [--json OUT]

DIR: a transformers checkpoint (SmolLM2-135M-Instruct: profiles/smollm2.py). The same weights are loaded twice,
`fused_projections=True` (the default: one product each for q/k/v and gate/up, weights joined at load) and False,
each compiled with the device's defaults (`Generator(compile=True)`, greedy kinds captured first), or with
`--eager` run by the eager steps (each projection its own call: where the joined layout changes the most
calls). Then greedy requests of 64 new tokens take turns between the two models and over the contexts, round
after round (a phase change of a shared machine hits both alike): decode ms/token (the prefill and first token
untimed) and the time to the first token, medians per (layout, context).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from capture import CaptureOptions  # noqa: E402
from static_decode import Generator, load_model  # noqa: E402
from static_decode.steps.functions import GREEDY_KINDS  # noqa: E402

NEW_TOKENS = 64
LAYOUTS = {"joined": True, "separate": False}


def timed_request(gen: Generator, prompt: list[int]) -> tuple[float, float]:
    """(ms to the first token, decode ms per token after it) of one greedy request."""
    t0 = time.perf_counter()
    stream = gen.stream(prompt, NEW_TOKENS, stop_at_eos=False)
    next(stream)
    t1 = time.perf_counter()
    n = len(list(stream))  # token ids, one by one (a single prompt)
    return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3 / max(n, 1)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--eager", action="store_true", help="eager steps (no compile): every projection a call")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    gens, capture_s = {}, {}
    for name, fused in LAYOUTS.items():
        model = load_model(args.model, dtype=args.dtype, fused_projections=fused)
        t0 = time.perf_counter()
        gens[name] = Generator(model, max_len=args.max_len, batch=1, compile=not args.eager,
                               capture=None if args.eager else CaptureOptions(kinds=GREEDY_KINDS, progress=False))
        capture_s[name] = round(time.perf_counter() - t0, 1)
    vocab = next(iter(gens.values())).model.config.vocab_size
    prompts = {L: [(i * 7919) % (vocab - 1) + 1 for i in range(L)] for L in contexts}
    tokens = {name: gen.generate(prompts[contexts[0]], 16, stop_at_eos=False) for name, gen in gens.items()}
    for gen in gens.values():
        for prompt in prompts.values():
            timed_request(gen, prompt)  # warm: every bucket the requests read
    ttft = {(n, L): [] for n in gens for L in contexts}
    decode = {(n, L): [] for n in gens for L in contexts}
    for r in range(args.rounds):
        order = list(gens) if r % 2 else list(gens)[::-1]
        for L in contexts if r % 2 else contexts[::-1]:
            for name in order:
                first, per_token = timed_request(gens[name], prompts[L])
                ttft[(name, L)].append(first)
                decode[(name, L)].append(per_token)
    doc = {
        "torch": torch.__version__, "threads": args.threads, "dtype": args.dtype, "model": str(args.model),
        "settings": "eager" if args.eager else next(iter(gens.values())).runner.settings.describe(),
        "capture_s": capture_s,
        "same_tokens": len({tuple(t) for t in tokens.values()}) == 1,
        "decode_ms_per_token": {n: {L: round(statistics.median(decode[(n, L)]), 3) for L in contexts} for n in gens},
        "first_token_ms": {n: {L: round(statistics.median(ttft[(n, L)]), 1) for L in contexts} for n in gens},
        "samples": {f"{n}@{L}": [round(x, 3) for x in decode[(n, L)]] for n in gens for L in contexts},
    }
    print(json.dumps({k: v for k, v in doc.items() if k != "samples"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()
