"""The multi-GPU check: tensor-parallel decode latency and the all-reduce share of a Llama-3.1-8B-shaped model.

Run under torchrun with N > 1 processes (static_decode.commands.launch: NCCL on CUDA, gloo on the CPU), is the
tensor-parallel check: every rank builds its shard of the same shape and, for each live length, times

    eager      the eager step (its 2 * layers all-reduces included)
    compiled   the compiled step at its ladder bucket (CUDA graphs with the all-reduces captured under NCCL)

and next to each, the all-reduces of one step alone: a [1, 1, hidden] tensor all-reduced 2 * layers times,
each sum feeding the next as the layers' do, run the same way as the step (eagerly, or compiled with the
step's settings). allreduce_share = all-reduce ms per step / step ms per token: near 0 the sharded weights'
bandwidth dominates, near 1 the collectives' latency does. Times are the slowest rank's. Rank 0 writes
gpu_check_tp{N}.json and gpu_check_tp{N}.md:

    python -m torch.distributed.run --standalone --nproc-per-node 2 profiles/gpu_check_tp.py

The shapes, timer and decode timing are profiles/gpu_check.py's. `--tiny --device cpu` runs the same logic on
a toy shape with gloo (tests/profiles/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402
from gpu_check_common import (  # noqa: E402
    Timer,
    copy_bandwidth,
    kv_bytes,
    parser,
    shape,
    time_decode,
    weight_bytes_per_token,
)

from capture import BucketLadder, CaptureOptions, CompileSettings  # noqa: E402
from static_decode import Generator, Llama  # noqa: E402
from static_decode.commands.launch import Launch, distributed_env, session  # noqa: E402
from static_decode.model.parallel import TensorParallel  # noqa: E402


def main() -> int:
    return main_tp(parser(__doc__.splitlines()[0]).parse_args())


def main_tp(args: argparse.Namespace) -> int:
    """Run this process as one rank of the torchrun group; rank 0 writes the results."""
    try:
        env = distributed_env()
    except ValueError as e:
        print(f"gpu_check_tp.py: error: {e}", file=sys.stderr)
        return 2
    if env is None:
        print("gpu_check_tp.py: error: needs torchrun with more than one process (WORLD_SIZE > 1), e.g. "
              "python -m torch.distributed.run --standalone --nproc-per-node 2 profiles/gpu_check_tp.py",
              file=sys.stderr)
        return 2
    try:
        with session(args.device) as launch:
            try:
                # Before allocating anything: a world size that splits a GQA group or the MLP is refused.
                launch.tp.check(shape(args.tiny).config)
            except ValueError as e:
                print(f"gpu_check_tp.py [rank {launch.tp.rank}]: error: {e}", file=launch.stderr)
                return 2
            try:
                return run_tp(args, launch)
            except Exception:
                # Ranks other than 0 have stderr silenced by the session: their traceback goes to the real one.
                print(f"gpu_check_tp.py [rank {launch.tp.rank}]: failed:", file=launch.stderr)
                traceback.print_exc(file=launch.stderr)
                return 1
    except ValueError as e:  # a device this rank cannot have (more ranks than GPUs)
        print(f"gpu_check_tp.py [rank {env[0]}]: error: {e}", file=sys.stderr)
        return 2


def run_tp(args: argparse.Namespace, launch: Launch) -> int:
    """Every rank runs this, the same collectives in the same order (each measurement ends in one)."""
    import torch.distributed as dist

    tp, device = launch.tp, launch.device
    sh = shape(args.tiny)
    cfg = sh.config
    steps = args.steps or (5 if args.tiny else 50)
    stem = f"gpu_check_tp{tp.world}"
    if launch.is_main:
        args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "shape": "tiny" if args.tiny else "llama-3.1-8b", "batch": 1,
                    "max_len": sh.max_len, "dtype": str(sh.dtype).removeprefix("torch."), "steps": steps,
                    "world": tp.world, "backend": launch.backend, "kv_heads_per_rank": cfg.num_kv_heads // tp.world,
                    "cases": []}

    def save() -> None:
        if launch.is_main:
            (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
            (args.out / f"{stem}.md").write_text(table_tp(result))

    def over_ranks(value: float, op: dist.ReduceOp) -> float:
        """`value` reduced over the ranks (a plain c10d collective, outside every timed region)."""
        t = torch.tensor([value], dtype=torch.float64, device=device)  # [1]
        dist.all_reduce(t, op=op)
        return t.item()

    timer = Timer(device)
    t0 = time.perf_counter()
    # The same seed on every rank: each rank fills its shard-shaped weights with random values of its own (the
    # same on every rank, as the shapes are), so the shards are not slices of one consistent model. That does
    # not matter for timing: decode_greedy over a fixed number of steps (no EOS) does the same work whatever
    # the token values, and nothing on the host depends on them.
    torch.manual_seed(0)
    model = Llama(cfg, dtype=sh.dtype, device=device, tp=tp)  # this rank's shard, random init on its device
    model.requires_grad_(False)
    result["init_s"] = round(over_ranks(time.perf_counter() - t0, dist.ReduceOp.MAX), 1)
    result["weight_bytes_per_rank"] = weight_bytes_per_token(model)  # sharded + the replicated embedding/head
    copy = copy_bandwidth(device, min(4 << 30, 4 * result["weight_bytes_per_rank"]) or 1 << 20, timer)
    result["copy_bytes_per_s"] = over_ranks(copy, dist.ReduceOp.MIN)  # per device, the slowest one
    eager = Generator(model, max_len=sh.max_len, batch=1, eos_token_ids=[])
    result["cache_bytes_per_rank"] = eager.cache.k.nbytes + eager.cache.v.nbytes  # this rank's KV heads only
    calls = 2 * cfg.num_layers  # one all-reduce after attention and one after the MLP, per layer
    x = torch.zeros(1, 1, cfg.hidden_size, dtype=sh.dtype, device=device)  # [1, 1, D]: zeros stay finite summed
    result["allreduce"] = {"calls_per_step": calls, "bytes_per_call": x.nbytes}
    save()

    def add_case(mode: str, live: int, read_len: int, seconds: float, ar_seconds: float, fallback: str) -> None:
        seconds, ar_seconds = over_ranks(seconds, dist.ReduceOp.MAX), over_ranks(ar_seconds, dist.ReduceOp.MAX)
        # Per rank: its weight shard (+ the replicated parts) and its KV heads of the live cache.
        useful = result["weight_bytes_per_rank"] + kv_bytes(cfg, live + steps // 2, sh.dtype) // tp.world
        result["cases"].append({
            "mode": mode, "live": live, "read_len": read_len, "ms_per_token": seconds * 1e3,
            "allreduce_ms_per_step": ar_seconds * 1e3, "allreduce_share": ar_seconds / seconds,
            "useful_gb_per_s_per_rank": useful / seconds / 1e9,
            "fraction_of_copy": useful / seconds / result["copy_bytes_per_s"], "fallback": fallback,
        })
        save()
        print(json.dumps(result["cases"][-1]), flush=True)

    # Eager cases first: they need no compile, so a run cut short by its timeout still has them.
    chain_eager = allreduce_chain(tp, x, calls)
    for live in sh.lengths:
        ar = time_allreduce(chain_eager, steps, timer)
        add_case("eager", live, live + steps, time_decode(eager, live, steps, None, timer), ar, "")

    ladder = BucketLadder.default(sh.max_len) if not args.tiny else BucketLadder.geometric(sh.max_len, align=16)
    buckets = {n: ladder.bucket_for(n + steps) for n in sh.lengths}
    graph_ladder = BucketLadder(tuple(sorted(set(buckets.values()) | {sh.max_len})))
    # What the Generator itself would pick for this group (reduce-overhead under NCCL, no CUDA graphs with gloo
    # on CUDA), unless --backend overrides it; spelled out so the all-reduce chain compiles the same way.
    settings = (CompileSettings(backend=args.backend) if args.backend != "inductor"
                else CompileSettings.for_device(device, collectives=launch.backend))
    result["compile"] = settings.describe()
    result["cudagraphs"] = settings.cudagraphs(device)
    # Lazy, then warm up only the buckets measured: max_len (the ladder's last rung) is not timed here.
    opts = CaptureOptions(buckets=graph_ladder, settings=settings, kinds=("decode_greedy",), progress=False,
                          warm_up="lazy")
    t0 = time.perf_counter()
    graphs = Generator(model, max_len=sh.max_len, batch=1, compile=True, eos_token_ids=[], capture=opts)
    graphs.warm_up(["decode_greedy"], buckets=sorted(set(buckets.values())), progress=False)
    result["capture_s"] = round(over_ranks(time.perf_counter() - t0, dist.ReduceOp.MAX), 1)
    result["ladder"] = list(graph_ladder.lengths)
    result["fallbacks"] = dict(graphs.runner.fallbacks)  # a kind that failed to compile runs eagerly
    try:
        chain_compiled = allreduce_chain(tp, x, calls, settings)
        result["allreduce"]["compiled"] = settings.describe()
    except Exception as e:  # every rank fails alike (same code, same settings): time the eager chain instead
        chain_compiled = chain_eager
        result["allreduce"]["compiled_error"] = f"{type(e).__name__}: {str(e).strip()[:200]}"
    save()
    for live in sh.lengths:
        ar = time_allreduce(chain_compiled, steps, timer)
        seconds = time_decode(graphs, live, steps, buckets[live], timer)
        add_case("compiled", live, buckets[live], seconds, ar, result["fallbacks"].get("decode_greedy", ""))
    print(table_tp(result))
    return 0


def allreduce_chain(
    tp: TensorParallel, x: torch.Tensor, calls: int, settings: CompileSettings | None = None
) -> Callable[[], None]:
    """The collectives of one decode step alone: `calls` all-reduces of x ([1, 1, D]), each summing the last
    one's result, as each layer's input is the previous all-reduce's output. settings None: eagerly (each
    result waited on before the next is issued); else compiled with the steps' settings and warmed up."""
    import torch.distributed._functional_collectives as funcol

    def waited(t: torch.Tensor) -> torch.Tensor:
        # Eager functional collectives return an AsyncCollectiveTensor; wait() blocks on gloo and makes the
        # current stream wait on NCCL, so the timer's end event comes after the reduction itself.
        return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t

    def chain(t: torch.Tensor) -> torch.Tensor:
        for _ in range(calls):
            t = waited(tp.all_reduce(t))  # [1, 1, D]
        return t

    if settings is None:

        def run_eager() -> None:
            chain(x)

        return run_eager

    compiled = settings.compile(chain, graphs=1)
    cudagraphs = settings.cudagraphs(x.device)
    if cudagraphs:
        torch._dynamo.mark_static_address(x)  # as the steps' tensors: replayed without a copy-in

    def run() -> None:
        with torch.no_grad():
            if cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()  # the last output is dropped unread
            compiled(x)

    for _ in range(3):  # compile; under CUDA graphs: warm-up, record, replay
        run()
    return run


def time_allreduce(chain: Callable[[], None], steps: int, timer: Timer) -> float:
    """Seconds per step's worth of all-reduces, `steps` chains back to back (one warm-up chain first)."""
    with torch.no_grad():
        chain()
        return timer(chain, steps)


def table_tp(result: dict) -> str:
    gb = {k: result.get(k, 0) / 1e9 for k in ("weight_bytes_per_rank", "cache_bytes_per_rank", "copy_bytes_per_s")}
    ar = result.get("allreduce", {})
    compiled = result.get("compile", "-") + (" (CUDA graphs)" if result.get("cudagraphs") else "")
    notes = f" (compiled chain failed: {ar['compiled_error']})" if "compiled_error" in ar else ""
    notes += f"; fallbacks {result['fallbacks']}" if result.get("fallbacks") else ""
    lines = [
        f"# gpu_check_tp: {result['shape']} on {result['world']} x {result['device']} ({result['backend']}), "
        f"torch {result['torch']}",
        "",
        f"world {result['world']}, batch {result['batch']}, max_len {result['max_len']}, {result['dtype']}, "
        f"{result['steps']} steps per case. Per rank: weights read per token {gb['weight_bytes_per_rank']:.2f} GB, "
        f"KV cache {gb['cache_bytes_per_rank']:.2f} GB ({result['kv_heads_per_rank']} KV heads), device copy "
        f"{gb['copy_bytes_per_s']:.0f} GB/s (read + write). Compiled: {compiled}; capture "
        f"{result.get('capture_s', '-')} s; ladder {result.get('ladder')}. All-reduces per step: "
        f"{ar.get('calls_per_step', '-')} x {ar.get('bytes_per_call', '-')} B{notes}. Times: the slowest rank.",
        "",
        "| live | mode | read_len | ms/token | all-reduce ms/step | all-reduce share | GB/s per rank | of copy |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in result["cases"]:
        lines.append(f"| {c['live']} | {c['mode']} | {c['read_len']} | {c['ms_per_token']:.3f} | "
                     f"{c['allreduce_ms_per_step']:.3f} | {c['allreduce_share']:.0%} | "
                     f"{c['useful_gb_per_s_per_rank']:.0f} | {c['fraction_of_copy']:.0%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
