"""Decode latency and achieved bandwidth of a Llama-3.1-8B-shaped model: eager, CUDA graphs, full-length read.

Random bf16 weights initialised on the device (32 layers, hidden 4096, 32 query / 8 KV heads, head_dim 128,
FFN 14336, vocab 128256), batch 1, max_len 32k. For each live length (1k, 8k, 32k) the cache lengths are set
directly (the K/V values do not change the work of a fixed-shape step) and `--steps` greedy decode steps are
timed back to back with CUDA events, each appending one token:

    eager      the eager step, reading exactly the live length
    graphs     the compiled step (CUDA graphs on CUDA) at the ladder's bucket for that length
    full       the compiled step at read_len = max_len (what a cache without a ladder reads)

Achieved bandwidth = (weight bytes read per token + live KV bytes) / time, next to a device-to-device copy
measured in the same run ((read + write) bytes / time): how close a step is to the memory-bound floor.
`--tiny --device cpu` runs the same logic on a toy shape (tests/test_gpu_check.py).

Then decode attention alone at the same head shape (one layer, batch 1, bf16) for every attention formulation
at the same live lengths, as a fraction of the device copy rate: the SDPA/matmul ones eager (one call is a few
kernels), `flex` compiled (it only exists as a kernel under torch.compile on CUDA: inductor's flash-decoding
template, which splits the key axis). `--attention-only` skips the model (and its ~4 minutes of capture).

Writes gpu_check.json and gpu_check.md to --out (default: $OUT, else ./out); each result is written as soon
as it exists, so a run cut short still leaves what it measured. The multi-GPU (tensor-parallel) check is
profiles/gpu_check_tp.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from capture import BucketLadder, CaptureOptions, CompileSettings  # noqa: E402
from static_decode import Generator, Llama, LlamaConfig  # noqa: E402
from static_decode.config import RopeConfig  # noqa: E402

LLAMA_8B = LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
    head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=131072,
    rope=RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192),
)
TINY = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)


@dataclass
class Shape:
    config: LlamaConfig
    max_len: int
    lengths: tuple[int, ...]  # live lengths measured
    dtype: torch.dtype


def shape(tiny: bool) -> Shape:
    if tiny:
        return Shape(TINY, 256, (16, 64, 200), torch.float32)
    return Shape(LLAMA_8B, 32768, (1024, 8192, 32000), torch.bfloat16)


class Timer:
    """CUDA events on CUDA (device time of back-to-back work), wall clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn, reps: int) -> float:
        """Seconds per call of fn over `reps` back-to-back calls."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / reps
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps


def copy_bandwidth(device: torch.device, nbytes: int, timer: Timer) -> float:
    """Device-to-device copy: (read + write) bytes per second."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = min(timer(lambda: dst.copy_(src), 5) for _ in range(3))
    return 2 * nbytes / seconds


def weight_bytes_per_token(model: Llama) -> int:
    """Bytes of weights a decode step reads: all parameters, except the embedding table (one row is read)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.embed_tokens.weight
    if model.lm_head is not None:  # untied: the table itself is only gathered from
        total -= emb.numel() * emb.element_size() - emb.shape[1] * emb.element_size()
    return total


def kv_bytes(cfg: LlamaConfig, length: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * length * cfg.head_dim * torch.finfo(dtype).bits // 8


def parser(description: str) -> argparse.ArgumentParser:
    """The options of this script and of gpu_check_tp.py."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--tiny", action="store_true", help="a toy shape (for CPU tests of this script)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed per case (default 50, tiny 5)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (eager: logic tests only)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "out"))
    ap.add_argument("--attention-only", action="store_true", help="only the attention rows (no model, no capture)")
    ap.add_argument("--no-attention", action="store_true", help="no attention rows")
    return ap


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    device = torch.device(args.device)
    sh = shape(args.tiny)
    steps = args.steps or (5 if args.tiny else 50)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "shape": "tiny" if args.tiny else "llama-3.1-8b", "batch": 1,
                    "max_len": sh.max_len, "dtype": str(sh.dtype).removeprefix("torch."), "steps": steps,
                    "cases": []}

    def save() -> None:
        (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "gpu_check.md").write_text(table(result))

    timer = Timer(device)
    weights = sum(p.numel() for p in Llama(sh.config, device="meta").parameters()) * torch.finfo(sh.dtype).bits // 8
    result["copy_bytes_per_s"] = copy_bandwidth(device, min(4 << 30, 4 * weights) or 1 << 20, timer)
    save()

    if not args.attention_only:
        run_model(args, sh, steps, device, timer, result, save)
    if not args.no_attention:
        result["attention"] = attention(sh, steps, device, result["copy_bytes_per_s"], args.backend)
        save()
    print(table(result))
    return 0


def attention(sh: Shape, steps: int, device: torch.device, copy_bytes_per_s: float, backend: str) -> list[dict]:
    """Decode attention alone at the shape's head layout, every impl, at each live length (profiles/
    attention_bench.py), as a fraction of the copy rate. Eager impls first; flex compiled (CUDA only)."""
    from static_decode.attention import CPU_ONLY, IMPLS
    from static_decode.commands.bench_systems import load_profiles_module

    ab = load_profiles_module("attention_bench")  # profiles/attention_bench.py, beside this file

    cfg = sh.config
    ab.HQ, ab.HKV, ab.HEAD_DIM = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eager = tuple(i for i in IMPLS if i != "flex" and (device.type == "cpu" or i not in CPU_ONLY))
    kw = {"dtype": sh.dtype, "device": device, "repeats": 5, "bandwidth_gbps": copy_bytes_per_s / 1e9}
    runs = [(impl, False) for impl in eager]
    if device.type == "cuda" and backend == "inductor":
        runs += [(impl, True) for impl in ("flex", "sdpa_folded", "split_key")]
    rows = []
    for impl, compiled in runs:
        # One impl at a time: a formulation that fails on this device (split_key's CUDA kernel has not run on a
        # GPU yet) costs its own rows, not the rest of a scarce GPU session.
        try:
            rows += ab.attention_rows(sh.lengths, (impl,), compiled=compiled, **kw)
        except Exception as e:  # noqa: BLE001 - recorded per row and reported
            why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            rows += [{"impl": impl + ("+compile" if compiled else ""), "length": n, "error": why} for n in sh.lengths]
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def run_model(args: argparse.Namespace, sh: Shape, steps: int, device: torch.device, timer: Timer, result: dict,
              save) -> None:
    """The Llama-3.1-8B-shaped model: eager, CUDA graphs (bucketed) and a full-length read, per live length."""
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = Llama(sh.config, dtype=sh.dtype, device=device)  # random init, directly on the device
    model.requires_grad_(False)
    result["init_s"] = round(time.perf_counter() - t0, 1)
    result["weight_bytes"] = weight_bytes_per_token(model)
    save()
    ladder = BucketLadder.default(sh.max_len) if not args.tiny else BucketLadder.geometric(sh.max_len, align=16)
    buckets = {n: ladder.bucket_for(n + steps) for n in sh.lengths}
    graph_ladder = BucketLadder(tuple(sorted(set(buckets.values()) | {sh.max_len})))
    settings = None if args.backend == "inductor" else CompileSettings(backend=args.backend)
    opts = CaptureOptions(buckets=graph_ladder, settings=settings, kinds=("decode_greedy",), progress=False)
    eager = Generator(model, max_len=sh.max_len, batch=1, eos_token_ids=[])
    t0 = time.perf_counter()
    graphs = Generator(model, max_len=sh.max_len, batch=1, compile=True, eos_token_ids=[], capture=opts)
    result["capture_s"] = round(time.perf_counter() - t0, 1)
    result["ladder"] = list(graph_ladder.lengths)
    save()

    for live in sh.lengths:
        for name, gen, read_len in (
            ("eager", eager, None), ("graphs", graphs, buckets[live]), ("full", graphs, sh.max_len),
        ):
            seconds = time_decode(gen, live, steps, read_len, timer)
            useful = result["weight_bytes"] + kv_bytes(sh.config, live + steps // 2, sh.dtype)
            result["cases"].append({
                "mode": name, "live": live, "read_len": read_len or live + steps, "ms_per_token": seconds * 1e3,
                "useful_gb_per_s": useful / seconds / 1e9,
                "fraction_of_copy": useful / seconds / result["copy_bytes_per_s"],
            })
            save()
            print(json.dumps(result["cases"][-1]), flush=True)


def time_decode(gen: Generator, live: int, steps: int, read_len: int | None, timer: Timer) -> float:
    """Seconds per greedy decode step from `live` cached tokens, `steps` steps back to back (warm-up first).

    read_len None: the eager step reading exactly the live length (+ the steps of this run)."""
    from static_decode.steps import STEPS

    cache, bufs = gen.cache, gen.bufs
    fn = STEPS["decode_greedy"] if read_len is None else gen.step_fn("decode_greedy", read_len)
    n = read_len if read_len is not None else live + steps

    def reset() -> None:
        cache.lens.fill_(live)  # the cached K/V values do not change the work; only the lengths matter
        cache.host_lens[:] = live
        bufs.done.zero_()
        bufs.step.zero_()
        bufs.limit.fill_(steps)  # rows stay live for the whole run (a request's max_new_tokens would end them)
        bufs.next.fill_(1)

    def run_all() -> None:
        for _ in range(steps):
            fn(gen.model, cache, bufs, n)

    with torch.no_grad():
        reset()
        run_all()  # warm-up
        reset()
        seconds = timer(run_all, 1) / steps
    reset()
    cache.reset()
    return seconds


def table(result: dict) -> str:
    copy = result.get("copy_bytes_per_s", 0) / 1e9
    lines = [
        f"# gpu_check: {result['shape']} on {result['device']}, torch {result['torch']}",
        "",
        f"batch {result['batch']}, max_len {result['max_len']}, {result['dtype']}, {result['steps']} steps per "
        f"case; weights read per token {result.get('weight_bytes', 0) / 1e9:.2f} GB; device copy "
        f"{copy:.0f} GB/s (read + write); capture {result.get('capture_s', '-')} s; ladder {result.get('ladder')}",
        "",
        "| live | mode | read_len | ms/token | GB/s (weights + live KV) | of copy |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for c in result["cases"]:
        lines.append(f"| {c['live']} | {c['mode']} | {c['read_len']} | {c['ms_per_token']:.3f} | "
                     f"{c['useful_gb_per_s']:.0f} | {c['fraction_of_copy']:.0%} |")
    if result.get("attention"):
        lines += ["", "decode attention alone (one layer, one query per head), live K/V bytes / best time:", "",
                  "| impl | live | ms | GB/s | of copy |", "| --- | ---: | ---: | ---: | ---: |"]
        for r in result["attention"]:
            if "error" in r:
                lines.append(f"| {r['impl']} | {r['length']} | failed: {r['error']} | | |")
                continue
            lines.append(f"| {r['impl']} | {r['length']} | {r['ms']:.4f} | {r['gbps']:.0f} | "
                         f"{r['bandwidth_fraction']:.0%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

