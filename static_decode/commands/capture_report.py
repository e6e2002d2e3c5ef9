"""`static-decode capture-report`: compile every (kind, bucket) of a model's steps and report what capture did.

One row per pair: compile seconds, graphs, graph breaks, recompiles, cudagraph skips and, on CUDA, the memory the
capture reserved. `--check BASELINE.json` exits non-zero when the pairs, or any pair's graphs, breaks, skips or
eager fallback, differ from the baseline (capture.report.CaptureReport.differences). The options:
docs/compile.md#capture-report.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

from capture.compile_cache import cache_counts
from capture.report import CaptureReport
from capture.settings import CaptureOptions, CompileSettings
from static_decode.checkpoints.loading import default_model_path, load_model
from static_decode.commands.args import (
    add_quantize_argument,
    add_threads_argument,
    apply_threads,
    check_checkpoint,
    check_device,
    int_list,
    name_list,
)
from static_decode.generation.generator import DEFAULT_CHUNK_SIZE, Generator


def build_report(
    model: Any,
    *,
    max_len: int,
    chunk_size: int,
    batch: int = 1,
    buckets: Any = None,
    kinds: tuple[str, ...] | None = None,
    settings: Any = None,
    progress: bool = True,
    compile_cache: Path | None = None,
) -> CaptureReport:
    """Compile every (kind, bucket) of a Generator over `model` and return the records (model: a Llama)."""
    opts = CaptureOptions(buckets=buckets, settings=settings, warm_up="lazy", progress=progress,
                          compile_cache=compile_cache)
    gen = Generator(model, max_len=max_len, chunk_size=chunk_size, batch=batch, compile=True, capture=opts)
    runner = gen.runner
    before = cache_counts()
    report = gen.warm_up(kinds, progress=progress)
    report.meta |= {
        "max_len": max_len, "chunk_size": chunk_size, "batch": batch, "ladder": list(runner.ladder.lengths),
        "kinds": list(kinds or runner.kinds), "dtype": str(model.dtype).removeprefix("torch."),
    }
    if compile_cache is not None:  # hits: what this process did not have to compile again
        after = cache_counts()
        report.meta["compile_cache"] = str(compile_cache)
        report.meta["inductor_cache"] = {k: after[k] - before[k] for k in after}
    return report


def print_whole(table: Any) -> None:
    """Print a rich table with every column: as wide as the terminal allows on one, at its natural width when
    stdout is a pipe or a file (rich would otherwise assume 80 columns and drop or squeeze some)."""
    from rich.console import Console

    console = Console()
    if console.is_terminal:
        Console(width=max(100, console.width)).print(table)
        return
    natural = Console(width=100_000).measure(table).maximum
    Console(width=natural, soft_wrap=False).print(table)


def _settings(args: Any, device: Any, launch: Any) -> CompileSettings | None:
    """--read-len over the device default (None: the runner picks the default itself)."""
    if args.read_len is None:
        return None
    base = CompileSettings.for_device(device, collectives=launch.backend if launch else None)
    return dataclasses.replace(base, symbolic_read_len=args.read_len == "symbolic")


def run_capture_report(args: Any) -> int:
    """The CLI command: build, print the table, optionally write JSON and check against a baseline."""
    launch = getattr(args, "launch", None)  # under torchrun: this rank's shard, device and collectives
    if launch is None or args.threads is not None:  # under torchrun the launcher shares the cores by default
        apply_threads(args)
    device = launch.device if launch else check_device(args.device)  # a device this machine lacks fails first
    path = check_checkpoint(args.model or default_model_path())
    baseline = CaptureReport.read_json(args.check) if args.check else None  # a bad baseline fails first
    model = load_model(path, dtype=args.dtype, device=device, quantize=args.quantize,
                       **({"tp": launch.tp} if launch else {}))
    report = build_report(
        model, max_len=args.max_len, chunk_size=args.chunk_size, batch=args.batch, buckets=args.buckets,
        kinds=args.kinds, settings=_settings(args, device, launch), progress=not args.quiet,
        compile_cache=args.compile_cache,
    )
    report.meta["model"] = "embedded default" if args.model is None else str(path)
    if launch is not None:
        report.meta["tensor_parallel"] = {"world": launch.tp.world, "backend": launch.backend}
    print_whole(report.table())  # rank 0's (the others print to /dev/null)
    if args.json and (launch is None or launch.is_main):
        report.write_json(args.json)
    if baseline is None:
        return 0
    diffs = report.differences(baseline)
    if (baseline.settings, baseline.meta.get("torch")) != (report.settings, torch.__version__):
        print(f"capture-report --check: note: baseline made with {baseline.settings}, torch "
              f"{baseline.meta.get('torch')}; this run: {report.settings}, torch {torch.__version__}", file=sys.stderr)
    for line in diffs:
        print(f"capture-report --check {args.check}: {line}", file=sys.stderr)
    if diffs:
        return 1
    print(f"capture-report --check {args.check}: graphs, graph breaks, cudagraph skips and fallbacks match",
          file=sys.stderr)
    return 0


def add_parser(subparsers: Any) -> None:
    """Register `capture-report` with the static-decode CLI (static_decode/commands/cli.py's COMMAND_MODULES)."""
    p = subparsers.add_parser("capture-report", help="compile every (kind, bucket) and report graphs, breaks, skips")
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint dir, .gguf file or Hub id org/name[@revision] (default: embedded model)")
    p.add_argument("--max-len", type=int, default=4096, help="cache capacity (the ladder's last bucket)")
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
                   help=f"prompt slots per prefill step (default {DEFAULT_CHUNK_SIZE}, the generator's)")
    p.add_argument("--batch", type=int, default=1, help="cache rows")
    p.add_argument("--buckets", type=int_list, default=None, help="read lengths, e.g. 256,1024,4096 (default ladder)")
    p.add_argument("--kinds", type=name_list, default=None,
                   help="step kinds to compile, e.g. prefill,first_greedy,decode_greedy (default: all)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    add_quantize_argument(p)
    p.add_argument("--json", type=Path, default=None, help="write the report as JSON to this path")
    p.add_argument("--check", type=Path, default=None, help="baseline JSON: exit 1 if graphs/breaks/skips differ")
    p.add_argument("--read-len", choices=("static", "symbolic"), default=None,
                   help="compile the read length static (a graph per bucket) or symbolic (a graph per kind); "
                        "default: the device's (symbolic on CPU, static on CUDA)")
    p.add_argument("--compile-cache", type=Path, default=None, metavar="DIR",
                   help="persistent compile cache directory: a later run with the same DIR skips inductor's work")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_threads_argument(p)
    p.set_defaults(run=run_capture_report, distributed=True)
