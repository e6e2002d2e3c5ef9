"""A decode step's fixed cost: what it spends besides reading weights, on a weightless model of a real layout.

    python profiles/fixed_cost.py [--layers 30 --heads 9 --kv-heads 3 --head-dim 64] [--dtype bfloat16]
                                  [--contexts 128,1024] [--rounds 8] [--threads 2] [--json OUT]

The model has the layer structure given (default: SmolLM2-135M's 30 layers, 9 query / 3 KV heads of 64), but
hidden and intermediate sizes of 64 and a 256-token vocabulary: ~7 MB of weights, which stay in the L3.

It is compiled with the CPU defaults (`Generator(compile=True)`), and greedy decode is timed: ms/token, median of
`--rounds` requests of 64 tokens, the contexts taking turns. The K/V are the real model's size.

What it measures is the part of a step that the model's width does not change:
- ~5 kernel calls per layer through the dispatcher;
- the small kernels between them;
- the compiled frames and their guards;
- the attention over the live keys;
- the host loop.

The real model's step costs about this plus its weights' reading time (profiles/RESULTS.md, "Fixed cost around
the kernels": 2.8-4.0 ms at context 128 against a 12.6-16.7 ms SmolLM2 bf16 step). The fused decode layers
(static_decode.model.fused_decode, on in the CPU default) took it from 2.51 / 3.91 to 1.24-1.32 / 2.17-2.50 ms at
128 / 1,024 (profiles/results/2026-12-01-fixed-cost-smollm2-layout-fused-layers.json).
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
from static_decode import Generator, Llama, LlamaConfig  # noqa: E402
from static_decode.steps.functions import GREEDY_KINDS  # noqa: E402

WIDTH, VOCAB, NEW_TOKENS = 64, 256, 64


def weightless(layers: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> Llama:
    """The layer structure given, every weight matrix a few KB (hidden and inner width WIDTH, vocabulary VOCAB)."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=WIDTH, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Llama(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)  # small weights: the logits stay finite and the tokens vary
    return model.to(dtype).eval()


def ms_per_token(gen: Generator, prompt: list[int]) -> float:
    """Decode wall time per token of one greedy request (the prefill and the first token untimed)."""
    stream = gen.stream(prompt, NEW_TOKENS, stop_at_eos=False)
    next(stream)
    t0 = time.perf_counter()
    n = len(list(stream))
    return (time.perf_counter() - t0) * 1e3 / n


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    model = weightless(args.layers, args.heads, args.kv_heads, args.head_dim, getattr(torch, args.dtype))
    t0 = time.perf_counter()
    gen = Generator(model, max_len=args.max_len, batch=1, compile=True,
                    capture=CaptureOptions(kinds=GREEDY_KINDS, progress=False))
    capture_s = time.perf_counter() - t0
    prompts = {L: [(i * 7919) % (VOCAB - 1) + 1 for i in range(L)] for L in contexts}
    for prompt in prompts.values():
        ms_per_token(gen, prompt)  # warm: every bucket the requests read
    samples: dict[int, list[float]] = {L: [] for L in contexts}
    for r in range(args.rounds):
        for L in contexts if r % 2 else contexts[::-1]:
            samples[L].append(ms_per_token(gen, prompts[L]))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    doc = {
        "torch": torch.__version__, "threads": args.threads, "dtype": args.dtype, "capture_s": round(capture_s, 1),
        "layout": {"layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                   "width": WIDTH, "vocab": VOCAB, "weight_bytes": weights},
        "settings": gen.runner.settings.describe(),
        "ms_per_token": {L: round(statistics.median(x), 3) for L, x in samples.items()},
        "samples": {L: [round(v, 3) for v in x] for L, x in samples.items()},
    }
    print(f"weightless {args.layers}-layer model ({weights / 1e6:.1f} MB of {args.dtype} weights), "
          f"{args.threads} threads, {doc['settings']}")
    for L in contexts:
        print(f"  context {L:6d}: {doc['ms_per_token'][L]:.3f} ms/token (median of {args.rounds})")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()
