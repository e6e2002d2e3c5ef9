"""What profiles/gpu_check.py and profiles/gpu_check_tp.py share: the shapes, the timer, the bytes a step reads,
decode timing over the compiled steps, and the JSON-lines rows every measurement is appended to.

Timing: on CUDA with CUDA events around many back-to-back calls (graph replays for compiled steps), so the time is
the device's and not one synchronised wall-clock call; elsewhere the wall clock (the CPU dry run)."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from static_decode import Generator, Llama, LlamaConfig
from static_decode.model.config import RopeConfig

LLAMA_8B = LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
    head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=131072,
    rope=RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192),
)
# The dry run's shape: power-of-two group and head_dim (flex's constraints), several KV heads.
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

    def __call__(self, fn: Callable[[], Any], reps: int) -> float:
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


def copy_bandwidth(device: torch.device, nbytes: int, timer: Timer, reps: int = 5) -> float:
    """Device-to-device copy: (read + write) bytes per second, best of 3 runs of `reps` copies."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = min(timer(lambda: dst.copy_(src), reps) for _ in range(3))
    return 2 * nbytes / seconds


def weight_bytes_per_token(model: Llama) -> int:
    """Bytes of weights a decode step reads: all parameters, except the embedding table (one row is read)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.embed_tokens.weight
    if model.lm_head is not None:  # untied: the table itself is only gathered from
        total -= emb.numel() * emb.element_size() - emb.shape[1] * emb.element_size()
    return total


def kv_bytes(cfg: LlamaConfig, length: int, dtype: torch.dtype) -> int:
    """K and V bytes of `length` tokens; an int8 cache adds its float32 scale per token and KV head."""
    if dtype == torch.int8:
        return 2 * cfg.num_layers * cfg.num_kv_heads * length * (cfg.head_dim + 4)
    return 2 * cfg.num_layers * cfg.num_kv_heads * length * cfg.head_dim * torch.finfo(dtype).bits // 8


def parser(description: str) -> argparse.ArgumentParser:
    """The options of gpu_check_tp.py (and the measuring options of gpu_check.py)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--tiny", action="store_true", help="a toy shape (for CPU tests of this script)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed per case (default 50, tiny 5)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (eager: logic tests only)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "out"))
    return ap


def time_decode(gen: Generator, live: int, steps: int, read_len: int | None, timer: Timer) -> float:
    """Seconds per greedy decode step from `live` cached tokens, `steps` steps back to back (warm-up first): on
    CUDA `steps` graph replays between two events.

    read_len None: the eager step reading exactly the live length (+ the steps of this run)."""
    from static_decode.steps.functions import STEPS

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


class Rows:
    """The JSON-lines file every measurement is appended to the moment it exists (flushed and synced: a phase
    killed by its time budget keeps every row before it)."""

    def __init__(self, path: Path, phase: str) -> None:
        self.path, self.phase, self.t0 = path, phase, time.perf_counter()
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, kind: str, **fields: Any) -> dict[str, Any]:
        row = {"phase": self.phase, "kind": kind, **fields, "t_s": round(time.perf_counter() - self.t0, 2)}
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(json.dumps(row, default=str), flush=True)
        return row


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every complete row of a rows file (a line cut short by a kill is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
