"""What every phase of profiles/gpu_check.py is given (Ctx) and the helpers the phase files share: device sync, a
function timed as a replayed CUDA graph, a random-weight model of a shape, compiled greedy tokens against eager's.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gpu_check_common import Rows, Shape, Timer, copy_bandwidth, read_rows, shape

from capture import CompileSettings
from static_decode import Generator, Llama

GREEDY_TOKENS = 32  # compiled greedy tokens compared with eager's
PROMPT = 16  # prompt tokens of those comparisons


@dataclass
class Ctx:
    """What a phase is given: the dry-run flag, the device, its rows file and its deadline."""

    dry: bool
    device: torch.device
    rows: Rows
    deadline: float  # time.perf_counter() by which the phase should have finished
    cache_dir: Path  # the compile cache the cold and warm captures share
    rows_path: Path

    @property
    def sh(self) -> Shape:
        return shape(self.dry)

    @property
    def steps(self) -> int:
        return 3 if self.dry else 50

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def settings(self, *, symbolic: bool = True, options: dict[str, Any] | None = None) -> CompileSettings:
        """CUDA: the device default (reduce-overhead, symbolic read length) or `options` with CUDA graphs; dry run:
        dynamo only (backend eager), the same read-length switch."""
        if self.dry:
            return CompileSettings(backend="eager", symbolic_read_len=symbolic)
        if options:
            return CompileSettings(options={"triton.cudagraphs": True, **options}, symbolic_read_len=symbolic)
        return dataclasses.replace(CompileSettings.for_device(self.device), symbolic_read_len=symbolic)

    def copy_gbps(self) -> float:
        """The env phase's copy rate (measured here if that phase left none)."""
        for r in read_rows(self.rows_path):
            if r.get("kind") == "copy":
                return float(r["gbps"])
        return copy_bandwidth(self.device, 1 << 20 if self.dry else 1 << 30, Timer(self.device)) / 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)



def _replayed(fn: Callable[[], None], device: torch.device, timer: Timer, reps: int) -> float:
    """Seconds per call of fn: on CUDA captured once into a CUDA graph and replayed `reps` times between events."""
    for _ in range(2 if device.type == "cuda" else 1):
        fn()  # compile, warm up
    sync(device)
    if device.type != "cuda":
        return timer(fn, reps)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    return timer(graph.replay, reps)



def _model(cfg, sh: Shape, device: torch.device, **kw: Any) -> Llama:
    torch.manual_seed(0)
    return Llama(cfg, dtype=sh.dtype, device=device, **kw).requires_grad_(False)



def greedy_row(ctx: Ctx, model: Llama, gen: Generator, check: str) -> None:
    """Compiled greedy tokens against eager's. Where they part, the step is a tie if eager's logits of the two
    tokens there lie within 4 bfloat16 ulps of each other (random weights make near ties)."""
    prompt = torch.randint(0, model.config.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    compiled = gen.generate(prompt, GREEDY_TOKENS, stop_at_eos=False)
    eager = Generator(model, max_len=PROMPT + GREEDY_TOKENS + 8, batch=1, eos_token_ids=[])
    want = eager.generate(prompt, GREEDY_TOKENS, stop_at_eos=False)
    first = next((i for i, (a, b) in enumerate(zip(want, compiled, strict=True)) if a != b), None)
    row: dict[str, Any] = {"check": check, "tokens": len(want), "first_diff": first, "tokens_equal": first is None}
    ok = first is None
    if first is not None:
        ctx_tokens = torch.tensor([prompt + want[:first]], device=model.device)  # [1, L]
        cache = model.new_cache(1, ctx_tokens.shape[1])
        with torch.no_grad():
            logits = model(ctx_tokens, cache, [ctx_tokens.shape[1]])[0, -1].float()  # [V]
        a, b = float(logits[want[first]]), float(logits[compiled[first]])
        ulp = 2.0 ** (math.floor(math.log2(max(abs(a), 1e-3))) - 7)
        row.update(margin=a - b, tie=abs(a - b) <= 4 * ulp)
        ok = row["tie"]
    ctx.rows.add("correct", **row, ok=ok)
