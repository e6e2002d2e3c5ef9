"""Shared test helper: what one tensor-parallel rank computes, run in processes spawned with the gloo backend.

`results(ckpt, tp, compile_mode)` is the same function for a rank of a tensor-parallel group and for the
single-process reference (tp = SINGLE), so the test compares like with like. `spawn(...)` starts `world`
processes (torch.multiprocessing, gloo over TCP on localhost) and returns each rank's results.
"""

from __future__ import annotations

import socket
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from capture import BucketLadder, CaptureOptions, CompileSettings
from static_decode import Generator, load_model
from static_decode.model.parallel import SINGLE, TensorParallel, open_group

PROMPTS = [[5, 17, 33, 2, 90, 61, 7, 8, 1], [40, 41], [9] * 13]  # ragged: 9, 2, 13 tokens
NEW_TOKENS = 10
MAX_LEN, CHUNK = 32, 4
GREEDY = ("prefill", "first_greedy", "decode_greedy")
# model.forward over a ragged batch in three chunks: (tokens [2, T], n_new)
FORWARD_CHUNKS = (
    ([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]], [5, 2]),
    ([[5, 8, 9, 0, 0], [5, 8, 9, 7, 9]], [3, 5]),
    ([[3, 2, 0, 0, 0], [3, 0, 0, 0, 0]], [2, 1]),
)


class CountCollectives:
    """A torch.compile backend that counts the all_reduce calls in each graph dynamo hands it, then runs it."""

    def __init__(self) -> None:
        self.per_graph: list[int] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.per_graph.append(
            sum(1 for n in gm.graph.nodes if n.op == "call_function" and "all_reduce" in str(n.target))
        )
        return gm.forward


def results(ckpt: Path, tp: TensorParallel, compile_mode: str | None) -> dict[str, Any]:
    """Logits of a chunked ragged forward, eager greedy tokens, cache bytes; compiled tokens and capture records
    when compile_mode is "inductor" (the CPU default settings) or "count" (dynamo graphs, all_reduces counted)."""
    model = load_model(ckpt, tp=tp)
    out: dict[str, Any] = {"rank": tp.rank, "world": tp.world}
    with torch.no_grad():
        cache = model.new_cache(2, MAX_LEN)
        out["logits"] = [model(torch.tensor(t), cache, n) for t, n in FORWARD_CHUNKS]
    gen = Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[])
    out["eager"] = gen.generate(PROMPTS, NEW_TOKENS)
    out["sampled"] = gen.generate(PROMPTS, NEW_TOKENS, temperature=0.9, top_p=0.9, seed=3)
    out["unseeded"] = gen.generate(PROMPTS, NEW_TOKENS, temperature=1.0)  # each rank's own random state
    out["cache_bytes"] = gen.cache.k.nbytes + gen.cache.v.nbytes
    out["cache_heads"] = gen.cache.kv_heads
    out["weight_elements"] = sum(p.numel() for p in model.parameters())
    if compile_mode is not None:
        counter = CountCollectives() if compile_mode == "count" else None
        settings = CompileSettings(backend=counter) if counter else None  # None: the CPU default (inductor)
        opts = CaptureOptions(buckets=BucketLadder((16, MAX_LEN)), settings=settings, kinds=GREEDY, progress=False)
        cgen = Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[], compile=True, capture=opts)
        out["compiled"] = cgen.generate(PROMPTS, NEW_TOKENS)
        out["records"] = [asdict(r) for r in cgen.capture_records]
        out["all_reduces_per_graph"] = counter.per_graph if counter else None
    return out


def _rank_main(rank: int, world: int, port: int, ckpt: Path, compile_mode: str | None, dest: Path) -> None:
    torch.set_num_threads(1)
    open_group("gloo", rank, world, f"tcp://127.0.0.1:{port}")
    try:
        tp = TensorParallel.current()  # what a script under torchrun does (docs/guide.md)
        if tp != TensorParallel(rank=rank, world=world):
            raise AssertionError(f"TensorParallel.current() is {tp}, expected rank {rank} of {world}")
        torch.save(results(ckpt, tp, compile_mode), dest / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, ckpt: Path, dest: Path, compile_mode: str | None = None) -> list[dict[str, Any]]:
    """Run `results` on `world` gloo ranks; return their results by rank (raises if any rank failed)."""
    mp.spawn(_rank_main, args=(world, free_port(), ckpt, compile_mode, dest), nprocs=world, join=True)
    return [torch.load(dest / f"rank{r}.pt", weights_only=False) for r in range(world)]


def single(ckpt: Path, compile_mode: str | None = None) -> dict[str, Any]:
    """The single-process reference (no process group)."""
    return results(ckpt, SINGLE, compile_mode)
