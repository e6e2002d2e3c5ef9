"""Where a decode step's time goes: static-decode's compiled step against transformers' compiled step.

    python profiles/decode_breakdown.py [--threads 1] [--contexts 128,1920] [--max-len 2048]

On the embedded default model, for each live context: the bare decode step (one token, no host loop, no
read-back) timed back to back, median of `--calls`, with the bench's settings (static-decode: the default
compile settings, reading the ladder's bucket; transformers: its docs' compiled decode step over a StaticCache
of max_len); then one torch.profiler pass per system splitting the step into

    guards     dynamo's guard evaluation before the graph runs ("TorchDynamo Cache Lookup")
    attention  aten::_scaled_dot_product_flash_attention_for_cpu (both systems' default attention on CPU)
    gemm       aten::mm / aten::addmm / aten::bmm (projections, MLP, head)
    step       the whole profiled call

static-decode is profiled with inductor's Python wrapper plus `cpp.enable_kernel_profile` (the default C++
wrapper calls the GEMMs and the attention below the profiler, so they would not show); its bare time uses the
default wrapper. Profiled times include the profiler's own per-op cost: compare them with each other, and use
the bare medians for absolute numbers. Results: profiles/RESULTS.md, "Decode benchmark".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from capture import BucketLadder, CaptureOptions, CompileSettings  # noqa: E402
from static_decode import Generator  # noqa: E402
from static_decode.checkpoints.loading import default_model_path, load_model  # noqa: E402
from static_decode.commands.bench import run as bench_run  # noqa: E402
from static_decode.commands.bench import systems as bench_systems  # noqa: E402

GROUPS = {
    "guards": ("TorchDynamo Cache Lookup",),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
    "gemm": ("aten::mm", "aten::addmm", "aten::bmm"),
}


def _static_step(model, max_len: int, context: int, prompt: list[int], settings) -> Callable[[], None]:
    """A bare compiled decode step of a Generator holding `context` tokens, at the ladder's bucket."""
    opts = CaptureOptions(settings=settings, warm_up="lazy", progress=False)  # compile only what runs
    gen = Generator(model, max_len=max_len, batch=1, compile=True, capture=opts)
    gen.generate(prompt[:context], 1, stop_at_eos=False)  # prefill; the cache now holds `context` tokens
    read_len = gen.read_len(context + 80)  # every step below stays inside this bucket
    step = gen.step_fn("decode_greedy", read_len)
    return lambda: step(model, gen.cache, gen.bufs, read_len)


def _hf_step(system, context: int, prompt: list[int]) -> Callable[[], None]:
    system.start(prompt[:context], 1)
    token = torch.tensor([[5]])
    return lambda: system._decode(token)


def measure(run: Callable[[], None], calls: int) -> float:
    """Median ms of `calls` back-to-back calls (after 5 untimed)."""
    with torch.no_grad():
        for _ in range(5):
            run()
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def split(run: Callable[[], None], calls: int = 20) -> dict[str, float]:
    """µs per step by group, from torch.profiler's self CPU times over `calls` steps."""
    with torch.no_grad():
        run()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                run()
    events = prof.key_averages()
    out = {g: sum(e.self_cpu_time_total for e in events if e.key in names) / calls for g, names in GROUPS.items()}
    out["step"] = sum(e.self_cpu_time_total for e in events) / calls
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", default="128,1920")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path()
    model = load_model(path)
    contexts = [int(c) for c in args.contexts.split(",")]
    prompt, _ = bench_run.make_prompt(path, model.config.vocab_size, max(contexts))
    kernel_profile = CompileSettings(options={"cpp.enable_kernel_profile": True})
    hf = bench_systems.TransformersSystem(path, model.dtype, model.device, args.max_len, compile=True)
    print(f"# threads {args.threads}, max_len {args.max_len}; transformers: {hf.mode}", flush=True)
    print("| system | context | read | bare step ms (median) | profiled step µs | guards µs | attention µs | "
          "gemm µs | other µs |\n|---|---|---|---|---|---|---|---|---|")
    for context in contexts:
        static = _static_step(model, args.max_len, context, prompt, None)
        static_profiled = _static_step(model, args.max_len, context, prompt, kernel_profile)
        read = BucketLadder.default(args.max_len).bucket_for(context + 80)
        hf_run = _hf_step(hf, context, prompt)
        for name, run, profiled, reads in (
            ("static-decode", static, static_profiled, read), ("transformers", hf_run, hf_run, args.max_len)
        ):
            bare = measure(run, args.calls)
            s = split(profiled)
            other = s["step"] - s["guards"] - s["attention"] - s["gemm"]
            print(f"| {name} | {context} | {reads} | {bare:.3f} | {s['step']:.0f} | {s['guards']:.0f} | "
                  f"{s['attention']:.0f} | {s['gemm']:.0f} | {other:.0f} |", flush=True)


if __name__ == "__main__":
    main()
