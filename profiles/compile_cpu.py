"""Which torch.compile setting makes the compiled decode step fastest on CPU (results: profiles/compile_cpu.md).

On the embedded default model (else a random model of its shape), batch 1, greedy, one process with an empty
inductor cache (so each variant's "compile s" is a cold compile of its graphs; a trivial compile first absorbs
one-time costs). Variants:

    eager            the Generator's eager steps (under no_grad, as the Generator launches them)
    default          torch.compile(fullgraph, dynamic=False), inductor defaults (Python wrapper)
    reduce-overhead  mode="reduce-overhead" (CPU tensors: no CUDA graph, counted as a cudagraph skip)
    max-autotune-no-cudagraphs
    cpp-wrapper      options={"cpp_wrapper": True} (the generated wrapper is C++, not Python)

The machine is shared and noisy, so timing is interleaved: each round times every variant once, and the table
gives the median and the best over rounds of

    ms/token  `Generator.stats.ms_per_step` of a request (prompt 96, 128 new tokens, read-back every 16 steps:
              what a user of `generate` sees);
    ms/step   a bare loop of 100 decode steps (no read-backs): the step's own cost.

    python profiles/compile_cpu.py [--rounds 7] [--threads 1] [--variant default --variant cpp-wrapper ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = ("eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "cpp-wrapper")
PROMPT_LEN, NEW_TOKENS, MAX_LEN = 96, 128, 256


def _model():
    import torch

    from static_decode import Llama, LlamaConfig

    path = ROOT / "static_decode" / "default_model"
    if (path / "config.json").is_file() and list(path.glob("*.safetensors")):
        from static_decode import load_model

        return load_model(path, device="cpu"), "embedded default model"
    torch.manual_seed(0)  # the default model's shape (training/train_default_model.py), random weights
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2,
        tie_word_embeddings=True,
    )
    return Llama(cfg), "random weights, default-model shape"


def _settings(variant: str):
    from capture import CompileSettings

    return {
        "default": CompileSettings(),
        "reduce-overhead": CompileSettings(mode="reduce-overhead"),
        "max-autotune-no-cudagraphs": CompileSettings(mode="max-autotune-no-cudagraphs"),
        "cpp-wrapper": CompileSettings(options={"cpp_wrapper": True}),
    }[variant]


def build(variant: str, model):
    """A Generator for `variant`, its cold compile seconds and compile counts."""
    from capture import CaptureOptions, count_compiles
    from static_decode import Generator
    from static_decode.steps.functions import GREEDY_KINDS

    compiled = variant != "eager"
    capture = CaptureOptions(settings=_settings(variant), kinds=GREEDY_KINDS, progress=False) if compiled else None
    t0 = time.perf_counter()
    with count_compiles() as c:
        gen = Generator(model, max_len=MAX_LEN, batch=1, compile=compiled, capture=capture, eos_token_ids=[])
    return gen, time.perf_counter() - t0, c.counts


def time_request(gen, prompt) -> tuple[float, list[int]]:
    tokens = gen.generate(prompt, NEW_TOKENS)
    return gen.stats.ms_per_step, tokens


def time_bare_steps(gen, steps: int = 100) -> float:
    """ms per decode step, `steps` back to back with no read-back (rows done: nothing appended, same work)."""
    import torch

    bucket = gen.read_len(PROMPT_LEN + NEW_TOKENS)
    step = gen.step_fn("decode_greedy", bucket)
    args = (gen.model, gen.cache, gen.bufs, bucket)
    gen.bufs.done.fill_(True)
    gen.bufs.step.zero_()  # the output index: `steps` more steps stay inside bufs.out
    with torch.no_grad():
        t = time.perf_counter()
        for _ in range(steps):
            step(*args)
        return (time.perf_counter() - t) * 1e3 / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=VARIANTS, action="append", help="run only these (default: all)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared machine)")
    args = ap.parse_args()
    variants = args.variant or list(VARIANTS)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile_cpu_")  # cold compiles
    import torch

    torch.set_num_threads(args.threads)
    torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(4))  # one-time inductor/compiler start-up
    model, source = _model()
    prompt = [(7 * i + 3) % model.config.vocab_size for i in range(PROMPT_LEN)]
    gens, rows = {}, {}
    for v in variants:
        gens[v], seconds, counts = build(v, model)
        rows[v] = {"compile_s": seconds, "graphs": counts.graphs, "skips": counts.cudagraph_skips, "ms": [],
                   "bare": [], "tokens": None}
        print(f"{v}: compiled in {seconds:.1f} s ({counts})", file=sys.stderr)
    for v in variants:  # one untimed request each (first-touch costs)
        rows[v]["tokens"] = time_request(gens[v], prompt)[1]
    load = []
    for r in range(args.rounds):
        for v in variants:
            ms, _ = time_request(gens[v], prompt)
            rows[v]["ms"].append(ms)
            rows[v]["bare"].append(time_bare_steps(gens[v]))
        load.append(os.getloadavg()[0])
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{v} {rows[v]['bare'][-1]:.2f}" for v in variants),
              file=sys.stderr)
    print(f"model: {source}; torch {torch.__version__}, {args.threads} thread(s); batch 1, prompt {PROMPT_LEN}, "
          f"{NEW_TOKENS} new tokens, max_len {MAX_LEN} (one read bucket); {args.rounds} interleaved rounds, "
          f"load average {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} cores\n")
    print("| variant | cold compile s (3 graphs) | graphs | cudagraph skips | ms/token median (best) "
          "| ms/step bare median (best) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for v in variants:
        r = rows[v]
        print(f"| {v} | {r['compile_s']:.0f} | {r['graphs']} | {r['skips']} | "
              f"{statistics.median(r['ms']):.2f} ({min(r['ms']):.2f}) | "
              f"{statistics.median(r['bare']):.2f} ({min(r['bare']):.2f}) |")
    same = len({tuple(rows[v]["tokens"]) for v in variants}) == 1
    print(f"\ngreedy tokens identical across variants: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
