"""Tensor-parallel decode on this CPU: per-token latency and the all-reduce share, world sizes 1 and 2.

    .venv/bin/python profiles/tp_cpu.py [--out profiles/results/DATE-tp-cpu.json]

For each model (the embedded default model, and a wider random one written to a temporary checkpoint so that
weight traffic, not launch overhead, dominates a step) and each world size, `world` processes are spawned
(gloo over localhost, one intra-op thread each, so world 2 uses both cores) and every rank runs the same
greedy requests through `Generator(compile=True)` (the CPU default compile: inductor's C++ wrapper) and
through the eager Generator. A reference row "world 1, 2 threads" gives the single process both cores too.

Per (model, world, mode), from rank 0:
    ms_per_token      median over `repeats` requests of GenerationStats.ms_per_step (every token back on
                      the host), after one warm-up request (which also compiles)
    allreduce_ms      the step's collectives alone: 2 x layers back-to-back all-reduces of a [1, 1, hidden]
                      float32 tensor (the functional collective the step uses, waited on), per step
    allreduce_share   allreduce_ms / ms_per_token: how much of a step is spent adding partial sums
Results go to --out (JSON) and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from capture import CaptureOptions  # noqa: E402
from static_decode import Generator, Llama, LlamaConfig, load_model  # noqa: E402
from static_decode.checkpoints.loading import default_model_path  # noqa: E402
from static_decode.model.llama import hf_name  # noqa: E402
from static_decode.model.parallel import SINGLE, TensorParallel, open_group  # noqa: E402
from static_decode.steps.functions import GREEDY_KINDS  # noqa: E402

# Wide enough that a decode step reads ~0.4 GB of weights (bandwidth-bound on one core), with 8 KV heads.
WIDE = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16,
                   num_kv_heads=8)


def write_checkpoint(config: LlamaConfig, path: Path) -> Path:
    """A random-weight checkpoint in transformers' layout (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = Llama(config)
    save_file({hf_name(n): p.detach().contiguous() for n, p in model.state_dict().items()},  # checkpoint names
              str(path / "model.safetensors"))
    c = config
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope.theta, "tie_word_embeddings": c.tie_word_embeddings,
    }))
    return path


def allreduce_ms(tp: TensorParallel, hidden: int, layers: int, reps: int = 50) -> float:
    """ms of one step's collectives: 2 x layers all-reduces of [1, 1, hidden], back to back, each waited on."""
    if not tp.enabled:
        return 0.0
    import torch.distributed._functional_collectives as funcol

    x = torch.ones(1, 1, hidden)  # [1, 1, D] float32, a decode step's partial sum

    def one_step() -> None:
        for _ in range(2 * layers):
            funcol.wait_tensor(tp.all_reduce(x))

    one_step()  # connect, warm up
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        one_step()
    return 1e3 * (time.perf_counter() - t0) / reps


def measure(ckpt: Path, tp: TensorParallel, args: argparse.Namespace) -> list[dict[str, Any]]:
    model = load_model(ckpt, tp=tp)
    c = model.config
    prompt = [(7 * i + 3) % c.vocab_size for i in range(args.context)]
    rows = []
    for mode in ("compiled", "eager"):
        # Only the greedy kinds are compiled: the sampling ones are not timed (and compile slowly on CPU).
        gen = Generator(model, max_len=args.max_len, batch=1, eos_token_ids=[], compile=mode == "compiled",
                        capture=CaptureOptions(kinds=GREEDY_KINDS, warm_up="lazy", progress=False))
        t0 = time.perf_counter()
        gen.generate(prompt, args.steps + 1)  # warm-up (compiles the pairs this request touches)
        setup = time.perf_counter() - t0
        samples = []
        for _ in range(args.repeats):
            gen.generate(prompt, args.steps + 1)
            samples.append(gen.stats.ms_per_step)
        ms = statistics.median(samples)
        ar = allreduce_ms(tp, c.hidden_size, c.num_layers)
        rows.append({
            "mode": mode, "world": tp.world, "threads": torch.get_num_threads(), "ms_per_token": round(ms, 3),
            "ms_per_token_samples": [round(s, 3) for s in samples], "allreduce_ms": round(ar, 3),
            "allreduce_share": round(ar / ms, 3), "setup_s": round(setup, 1),
            "weight_mb_per_rank": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20, 1),
        })
    return rows


def _rank(rank: int, world: int, port: int, ckpt: Path, args: argparse.Namespace, dest: Path) -> None:
    torch.set_num_threads(1)
    open_group("gloo", rank, world, f"tcp://127.0.0.1:{port}")
    try:
        rows = measure(ckpt, TensorParallel(rank=rank, world=world), args)
        if rank == 0:
            (dest / "rows.json").write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def run_world(ckpt: Path, world: int, threads: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        if world == 1:
            torch.set_num_threads(threads)
            return measure(ckpt, SINGLE, args)
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(world, port, ckpt, args, Path(tmp)), nprocs=world, join=True)
        return json.loads((Path(tmp) / "rows.json").read_text())


def table(doc: dict[str, Any]) -> str:
    lines = ["| model | world x threads | mode | ms/token | all-reduce ms/step | all-reduce share | weights/rank MB |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in doc["rows"]:
        lines.append(f"| {r['model']} | {r['world']} x {r['threads']} | {r['mode']} | {r['ms_per_token']:.2f} | "
                     f"{r['allreduce_ms']:.2f} | {r['allreduce_share']:.0%} | {r['weight_mb_per_rank']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per request")
    ap.add_argument("--repeats", type=int, default=5, help="timed requests per case")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--models", default="embedded,wide", help="comma-separated: embedded, wide")
    out = ROOT / "profiles" / "results" / f"{time.strftime('%Y-%m-%d')}-tp-cpu.json"
    ap.add_argument("--out", type=Path, default=out)
    args = ap.parse_args()
    from static_decode.commands.bench.machine import machine

    doc: dict[str, Any] = {"machine": machine(1, torch.device("cpu")), "context": args.context,
                           "steps": args.steps, "repeats": args.repeats, "max_len": args.max_len, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"embedded": default_model_path(), "wide": None}
        for name in args.models.split(","):
            path = paths[name] or write_checkpoint(WIDE, Path(tmp))
            for world, threads in ((1, 1), (1, 2), (2, 1)):
                for row in run_world(path, world, threads, args):
                    doc["rows"].append({"model": name, **row})
                    print(json.dumps(doc["rows"][-1]), flush=True)
                args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
