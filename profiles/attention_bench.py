"""Decode attention alone against this machine's read bandwidth.

    python profiles/attention_bench.py                       # decode, every impl, 1k..32k, float32
    python profiles/attention_bench.py --chunk 512 --cached 4096 --impls matmul
    python profiles/attention_bench.py --compile --markdown  # also torch.compile'd, as a markdown table

Llama-3.1-8B head shape (Hq 32, Hkv 8, d 128), B 1. The attention reads K and V of one layer through
`StaticKVCache.layer_view` (the real strided views of the preallocated buffer, read_len = live length) and
runs `grouped_attention` with each formulation in `static_decode.core.attention.IMPLS`. Reported per call:
best and median ms, GB/s of live K/V bytes (2 * Hkv * L * d * itemsize, the bytes a step must read), and
that rate as a fraction of the read bandwidth measured in the same run by a float32 sum over a 1 GiB tensor.

Each timed call starts with a cold last-level cache (a 96 MiB scratch buffer is written first, outside the
timing): in a real step the other layers' K/V and weights pass through the cache between two visits of a
layer, so a warm-cache number at 1k-4k (K/V of 4-32 MiB against a 32 MiB L3) would flatter the kernel.

The importable pieces (`read_bandwidth`, `time_attention`, `attention_rows`, `machine`) are what
`static-decode bench` puts under "attention" in its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from static_decode.commands.bench.machine import read_bandwidth as _read_bandwidth
from static_decode.commands.bench.timing import IdleGate
from static_decode.core.attention import DEFAULT_IMPL, IMPLS, grouped_attention
from static_decode.core.cache import StaticKVCache

HQ, HKV, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
_SCRATCH_BYTES = 96 << 20  # > 32 MiB L3 here; enough to evict K/V between timed calls


def machine() -> dict[str, object]:
    """The facts a number needs next to it: CPU model, cores, torch, threads, load now."""
    model = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    info: dict[str, object] = {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


# One /proc/stat idle reader for the whole project: the bench's.
cpu_idle_fraction = IdleGate.idle_fraction


# Shared machines: with --wait-idle, each timed call first waits (up to WAIT_IDLE_S) for a moment when the other
# users leave the CPUs idle, so that a 2-thread run is not timing the scheduler. Counted in IDLE_STATS.
WAIT_IDLE_S = 0.0
IDLE_STATS = {"calls": 0, "gave_up": 0}


def _wait_idle(threshold: float = 0.9) -> None:
    if WAIT_IDLE_S <= 0:
        return
    IDLE_STATS["calls"] += 1
    deadline = time.monotonic() + WAIT_IDLE_S
    while cpu_idle_fraction() < threshold:
        if time.monotonic() > deadline:
            IDLE_STATS["gave_up"] += 1
            return


def _timings(
    fn: Callable[[], object],
    repeats: int,
    *,
    flush: torch.Tensor | None,
    device: torch.device,
    warm_up: bool = True,
) -> list[float]:
    """Seconds per call of fn, `repeats` times after one warm-up; each call after a cache flush if given."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if warm_up:
        fn()
        sync()
    out = []
    for _ in range(repeats):
        if flush is not None:
            flush.add_(1)
        sync()
        _wait_idle()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Read bandwidth in GB/s (1e9 B/s): the best of `repeats` float32 sums over an nbytes tensor (the bench's own
    probe, `static-decode bench`'s "bandwidth")."""
    return _read_bandwidth(torch.device(device), nbytes, repeats)


def live_kv_bytes(read_len: int, dtype: torch.dtype, kv_heads: int = HKV, head_dim: int = HEAD_DIM) -> int:
    """Bytes of K and V a batch-1 step must read at this read length."""
    return 2 * kv_heads * read_len * head_dim * torch.empty((), dtype=dtype).element_size()


def time_attention(
    impls: tuple[str, ...],
    length: int,
    *,
    slots: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    repeats: int = 7,
    compiled: bool = False,
    flush: bool = True,
) -> dict[str, dict[str, float]]:
    """Time one layer's attention of `slots` new queries at live length `length` (cache + chunk), per impl.

    Returns {impl: {"best_ms", "median_ms"}}. The impls take turns call by call (impl 1, impl 2, ..., impl 1,
    ...), so a neighbour's burst of load on a shared machine hits all of them alike. The cache is filled with
    random K/V; the new slots are the last `slots` positions (decode: slots=1).
    """
    device = torch.device(device)
    if not 1 <= slots <= length:
        raise ValueError(f"slots={slots} must lie in 1..length={length}")
    cache = StaticKVCache(1, HKV, length, HEAD_DIM, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    cache.lens.fill_(length)
    cache.host_lens[:] = length
    k, v = cache.layer_view(0, length)  # [1, Hkv, length, d] views, strided by max_len + 1
    q = torch.randn(1, HQ, slots, HEAD_DIM, generator=gen, device=device).to(dtype)  # [1, Hq, T, d]
    lens = cache.lens  # lengths after the chunk
    n_new = torch.full((1,), slots, dtype=torch.int64, device=device)
    fn = grouped_attention
    if compiled:
        # One graph per (impl, length): more than dynamo's default recompile limit over a few impls and lengths.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        fn = torch.compile(grouped_attention, dynamic=False, fullgraph=True)
    scratch = torch.zeros(_SCRATCH_BYTES // 4, device=device) if flush else None
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for impl in impls:  # warm-up (and compile) each once
        _timings(lambda impl=impl: fn(q, k, v, lens, n_new, impl=impl), 0, flush=None, device=device)
    for _ in range(repeats):
        for impl in impls:
            call = lambda impl=impl: fn(q, k, v, lens, n_new, impl=impl)  # noqa: E731
            times[impl] += _timings(call, 1, flush=scratch, device=device, warm_up=False)
    return {impl: {"best_ms": 1e3 * min(t), "median_ms": 1e3 * statistics.median(t)} for impl, t in times.items()}


def attention_rows(
    lengths: tuple[int, ...] = LENGTHS,
    impls: tuple[str, ...] = (DEFAULT_IMPL,),
    *,
    slots: int = 1,
    cached: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    repeats: int = 7,
    compiled: bool = False,
    bandwidth_gbps: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, object]]:
    """Rows {"impl", "length", "slots", "ms", "median_ms", "gbps", "bandwidth_fraction", "gflops"} (bench JSON).

    Decode (slots=1) at each length; with `cached`, one chunk of `slots` after `cached` tokens instead
    (length = cached + slots). ms is the best of `repeats`; gbps counts live K/V bytes only.
    """
    if bandwidth_gbps is None:
        bandwidth_gbps = read_bandwidth(device=device)
    todo = [cached + slots] if cached is not None else list(lengths)
    rows = []
    for length in todo:
        if progress:
            progress(f"{','.join(impls)}{' compiled' if compiled else ''} L={length} T={slots}")
        timed = time_attention(
            impls, length, slots=slots, dtype=dtype, device=device, repeats=repeats, compiled=compiled
        )
        for impl, t in timed.items():
            gbps = live_kv_bytes(length, dtype, HKV, HEAD_DIM) / (t["best_ms"] / 1e3) / 1e9
            flops = 4 * HQ * slots * length * HEAD_DIM  # QK^T and PV over every (slot, key) pair, masked or not
            rows.append(
                {
                    "impl": impl + ("+compile" if compiled else ""),
                    "length": length,
                    "slots": slots,
                    "dtype": str(dtype).removeprefix("torch."),
                    "ms": round(t["best_ms"], 4),
                    "median_ms": round(t["median_ms"], 4),
                    "gbps": round(gbps, 3),
                    "bandwidth_fraction": round(gbps / bandwidth_gbps, 3),
                    "gflops": round(flops / (t["best_ms"] / 1e3) / 1e9, 2),
                }
            )
    order = {impl: n for n, impl in enumerate(impls)}
    rows.sort(key=lambda r: (order[str(r["impl"]).removesuffix("+compile")], r["length"]))
    return rows


def _qk_reduction(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # [Hkv, S, G]: each K row loaded once and reused for the G queries (inductor: one loop nest, no GEMM).
    # Compile-only: in eager this materialises a G x K temporary.
    return (k[:, :, None, :] * q[:, None, :, :]).sum(-1)


def _pv_reduction(p: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    # [Hkv, G, d] from p [Hkv, S, G]: partial sums over key blocks, then over blocks (compile-only, as above).
    h, s, g = p.shape
    pb = p.view(h, s // block, block, g)
    vb = v.unflatten(1, (s // block, block))  # [Hkv, blocks, block, d] (a view of the strided cache slice)
    return (pb[..., None] * vb[:, :, :, None, :]).sum(2).sum(1)


def gemm_rates(
    length: int = 32768, repeats: int = 5, *, warm: bool = False, reductions: bool = False
) -> dict[str, float]:
    """GB/s of the operand each decode GEMM streams (all 8 KV heads), next to a streaming sum.

    Diagnoses where the attention's time goes: the two skinny GEMMs of a decode step against `sum` over K.
    Cold cache by default; warm=True repeats on data left in cache (use a small length: the kernel's own rate).
    reductions=True adds the torch.compile'd elementwise-and-sum forms of QK^T and PV (compile-only experiments).
    """
    k = torch.randn(HKV, length + 1, HEAD_DIM)[:, :length]  # [Hkv, L, d], strided like the cache
    v = torch.randn(HKV, length + 1, HEAD_DIM)[:, :length]
    q = torch.randn(HKV, HQ // HKV, HEAD_DIM)  # [Hkv, G, d]
    p = torch.softmax(torch.randn(HKV, length, HQ // HKV), dim=1)  # [Hkv, L, G]
    scratch = torch.zeros(_SCRATCH_BYTES // 4)
    cpu = torch.device("cpu")
    nbytes = k.numel() * 4
    cases = {
        "sum(K)": lambda: k.sum(),
        "bmm(K, Q^T)": lambda: torch.bmm(k, q.transpose(1, 2)),
        "bmm(Q, K^T)": lambda: torch.bmm(q, k.transpose(1, 2)),
        "bmm(P^T, V)": lambda: torch.bmm(p.transpose(1, 2), v),
    }
    if reductions:
        qk = torch.compile(_qk_reduction, dynamic=False, fullgraph=True)
        pv = torch.compile(_pv_reduction, dynamic=False, fullgraph=True)
        torch.testing.assert_close(qk(q, k), torch.bmm(k, q.transpose(1, 2)), rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(pv(p, v, 64), torch.bmm(p.transpose(1, 2), v), rtol=1e-4, atol=1e-3)
        cases["compiled reduction QK^T"] = lambda: qk(q, k)
        cases["compiled reduction PV (64-key blocks)"] = lambda: pv(p, v, 64)
    flush = None if warm else scratch
    return {name: nbytes / min(_timings(fn, repeats, flush=flush, device=cpu)) / 1e9 for name, fn in cases.items()}


def profile_call(
    impl: str, length: int, *, slots: int = 1, dtype: torch.dtype = torch.float32, trace: str | None = None
) -> list[tuple[str, int]]:
    """Run one call under torch.profiler; return the copy-like ops that touched >= one K/V head of data.

    An empty list means K and V were consumed in place (K^T as a transposed view, no repeat, no contiguous()
    copy). With `trace`, also write a Chrome trace (open in ui.perfetto.dev or chrome://tracing).
    """
    from torch.profiler import ProfilerActivity, profile

    cache = StaticKVCache(1, HKV, length, HEAD_DIM, dtype=dtype)
    cache.lens.fill_(length)
    k, v = cache.layer_view(0, length)
    q = torch.randn(1, HQ, slots, HEAD_DIM).to(dtype)
    n_new = torch.full((1,), slots, dtype=torch.int64)
    grouped_attention(q, k, v, cache.lens, n_new, impl=impl)  # warm-up outside the trace
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        grouped_attention(q, k, v, cache.lens, n_new, impl=impl)
    if trace:
        prof.export_chrome_trace(trace)
    # A K/V copy has K's shape: (length, d) or, transposed, (d, length) in its last two dims. (Scores end in
    # (G*T, length); with G*T == d they would look alike, so keep G*T != 128 when checking: T != 32 here.)
    kv_like = {(length, HEAD_DIM), (HEAD_DIM, length)}
    copies = []
    copy_ops = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::repeat_interleave", "aten::repeat"}
    copy_ops |= {"aten::cat", "aten::_to_copy", "aten::expand_copy", "aten::index_select"}
    for ev in prof.events():
        if ev.name in copy_ops:
            for shape in ev.input_shapes:
                if len(shape) >= 2 and tuple(shape[-2:]) in kv_like:
                    copies.append((ev.name, tuple(shape)))
    return copies


def markdown(rows: list[dict[str, object]], bandwidth_gbps: float) -> str:
    lines = [
        f"read bandwidth (float32 sum over 1 GiB, best of 5): {bandwidth_gbps:.1f} GB/s",
        "",
        "| impl | dtype | T | live length | ms (best) | ms (median) | GB/s live K/V | fraction of read bw | GFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['impl']} | {r['dtype']} | {r['slots']} | {r['length']} | {r['ms']:.2f} | {r['median_ms']:.2f} "
            f"| {r['gbps']:.1f} | {r['bandwidth_fraction']:.2f} | {r['gflops']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    global WAIT_IDLE_S, HQ, HKV, HEAD_DIM
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, from {IMPLS}")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--chunk", type=int, default=1, help="slots per call (1 = decode)")
    parser.add_argument("--cached", type=int, help="with --chunk: tokens cached before the chunk")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--compile", action="store_true",
                        help="also time torch.compile(grouped_attention); with --gemms, add compiled reduction forms")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--heads", default=f"{HQ},{HKV},{HEAD_DIM}",
                        help="query heads, KV heads, head dim (default Llama-3.1-8B's; SmolLM2-135M: 9,3,64)")
    parser.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                        help="before each timed call wait up to S seconds for the CPUs to be >= 90%% idle (shared)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--json", metavar="PATH", help="write {machine, read_bandwidth_gbps, attention: rows}")
    parser.add_argument("--gemms", action="store_true", help="instead of timing attention: the decode GEMMs' GB/s")
    parser.add_argument("--warm", action="store_true", help="with --gemms: no cache flush (in-cache kernel rate)")
    parser.add_argument("--trace", metavar="PREFIX", help="instead of timing: profile one call per impl at the "
                        "first length, write PREFIX-<impl>.json (Chrome trace) and report any K/V-sized copy")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    WAIT_IDLE_S = args.wait_idle
    HQ, HKV, HEAD_DIM = (int(x) for x in args.heads.split(","))
    if HQ % HKV:
        parser.error(f"--heads {args.heads}: query heads must be a multiple of KV heads")
    impls = tuple(args.impls.split(","))
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        parser.error(f"unknown impl(s) {bad}; choose from {IMPLS}")
    lengths = tuple(int(x) for x in args.lengths.split(","))
    dtype = getattr(torch, args.dtype)
    if args.trace:
        length = (args.cached + args.chunk) if args.cached is not None else lengths[0]
        for impl in impls:
            path = f"{args.trace}-{impl}.json"
            copies = profile_call(impl, length, slots=args.chunk, dtype=dtype, trace=path)
            verdict = "no K/V-sized copy" if not copies else f"K/V-sized copies: {copies}"
            print(f"{impl}: L={length} T={args.chunk}: {verdict}; trace in {path}")
        return
    if args.gemms:
        for length in lengths:
            rates = gemm_rates(length, args.repeats, warm=args.warm, reductions=args.compile)
            print(f"L={length} threads={torch.get_num_threads()}: "
                  + ", ".join(f"{n} {g:.1f} GB/s" for n, g in rates.items()))
        return
    info = machine()
    bw = read_bandwidth(device=args.device)
    print(f"# {info}\n# read bandwidth {bw:.1f} GB/s", flush=True)
    rows = []
    for compiled in (False, True) if args.compile else (False,):
        rows += attention_rows(lengths, impls, slots=args.chunk, cached=args.cached, dtype=dtype, device=args.device,
                               repeats=args.repeats, compiled=compiled, bandwidth_gbps=bw,
                               progress=lambda s: print(f"# {s}", flush=True))
    if not args.markdown:
        for r in rows:
            print(r, flush=True)
    info["load_1min_after"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if WAIT_IDLE_S > 0:
        info["idle_waits"] = dict(IDLE_STATS)
    if args.markdown:
        print(f"# machine after: load {info['load_1min_after']}, idle waits {info.get('idle_waits')}\n")
        print(markdown(rows, bw))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "read_bandwidth_gbps": bw, "attention": rows}, f, indent=2)


if __name__ == "__main__":
    main()
