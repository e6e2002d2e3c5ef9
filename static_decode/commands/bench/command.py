"""`static-decode bench`: per-token decode latency and prefill time of every system, side by side, in one run.

The command's options and entry point; the run is static_decode.commands.bench.run (how it times), the
systems static_decode.commands.bench.systems, the tables, plot and checks static_decode.commands.bench.report.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from capture.settings import CompileSettings
from static_decode.commands.args import check_output, int_list, name_list
from static_decode.commands.bench.config import QUICK, BenchConfig
from static_decode.commands.bench.report import report
from static_decode.commands.bench.requests import FORMS
from static_decode.commands.bench.run import run
from static_decode.commands.bench.systems import SYSTEMS
from static_decode.model.quant import LOAD_CHOICES


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint dir, .gguf file or Hub id org/name[@revision] (default: embedded model)")
    p.add_argument("--gguf", action="append", default=None, metavar="[NAME=]PATH[,...]",
                   help="GGUFs of the same weights, one llama.cpp system each, named NAME or after the file's quant "
                   "type ('llama.cpp Q8_0'); comma-separated and/or repeated (llama.cpp is skipped without one)")
    p.add_argument("--contexts", type=int_list, default=None, help=f"live context lengths (default {d.contexts})")
    p.add_argument("--max-len", type=int, default=d.max_len, help="cache capacity (fixed over the sweep)")
    p.add_argument("--steps", type=int, default=None, help=f"timed decode steps per request (default {d.steps})")
    p.add_argument("--repeats", type=int, default=None, help=f"timed requests per point (default {d.repeats})")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed requests per point first")
    p.add_argument("--systems", type=name_list, default=SYSTEMS,
                   help=f"comma-separated, from {','.join(SYSTEMS)}")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--kv-dtype", default=None, choices=("float32", "bfloat16", "float16", "int8"),
                   help="static-decode's K/V cache dtype (default: the model's; llama.cpp's own default is f16)")
    p.add_argument("--quantize", default=None, metavar="FORM[,FORM...]",
                   help=f"static-decode's weight forms, each its own systems ('static-decode int8'): none (the "
                   f"checkpoint's dtype), {', '.join(LOAD_CHOICES)} (static_decode.model.quant; CPU), gguf "
                   f"(each --gguf file itself, its blocks as stored: 'static-decode Q4_K_M'); e.g. none,int4,gguf")
    p.add_argument("--requests", default=None, metavar="FORM[,FORM...]",
                   help=f"request forms static-decode is timed with, each its own system beside greedy "
                   f"('static-decode min-p'): {', '.join(FORMS)} (default greedy)")
    p.add_argument("--attention-lengths", type=int_list, default=None, help="attention microbenchmark lengths")
    p.add_argument("--no-attention", action="store_true", help="skip the attention microbenchmark")
    p.add_argument("--transformers-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile transformers' decode step as its docs show (default) or run it eager")
    p.add_argument("--compile-backend", default="inductor", choices=("inductor", "aot_eager", "eager"),
                   help="torch.compile backend of the compiled systems (not inductor: dynamo only, for debugging)")
    p.add_argument("--quick", action="store_true", help=f"a short sweep: {QUICK} unless given")
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of ms/token against context here")
    p.add_argument("--profile", type=Path, default=None, help="write a torch.profiler Chrome trace here")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="before each timed request wait up to S s for the CPUs to be >= 90%% idle (shared machines)")
    p.add_argument("--peer-timeout", type=float, default=d.peer_timeout, metavar="S",
                   help="the longest wait for one answer of a llama.cpp worker process (load, prefill, a request's "
                   "decode); past it the worker is killed and its row says it hung")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    d, q = BenchConfig(), QUICK if args.quick else {}

    def pick(name: str) -> Any:
        given = getattr(args, name)
        return given if given is not None else q.get(name, getattr(d, name))

    settings = None  # the device default of capture/
    if args.compile_backend != "inductor":
        settings = CompileSettings(backend=args.compile_backend)
    return BenchConfig(
        settings=settings, contexts=pick("contexts"), max_len=args.max_len, steps=pick("steps"),
        repeats=pick("repeats"),
        warmup=args.warmup, systems=args.systems, model=args.model, threads=args.threads, device=args.device,
        dtype=args.dtype, kv_dtype=args.kv_dtype, quantize=args.quantize,
        attention_lengths=None if args.no_attention else pick("attention_lengths"),
        transformers_compile=args.transformers_compile, progress=not args.quiet, profile=args.profile,
        wait_idle=args.wait_idle, gguf=args.gguf, peer_timeout=args.peer_timeout, requests=args.requests,
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench` with the static-decode CLI (static_decode/commands/cli.py's COMMAND_MODULES)."""
    p = subparsers.add_parser("bench", help="decode latency and prefill of every system side by side")
    add_arguments(p)
    p.set_defaults(run=run_cli, distributed=True)


def run_cli(args: argparse.Namespace) -> int:
    for flag in ("json", "plot", "profile"):  # written at the end: refused before minutes of benching
        check_output(f"--{flag}", getattr(args, flag))
    config = config_from_args(args)
    launch = getattr(args, "launch", None)  # under torchrun: this rank's shard and device
    if launch is not None:
        config.tp, config.device = launch.tp, str(launch.device)
    doc = run(config)
    if launch is None or launch.is_main:  # one rank writes the files
        report(doc, json_path=args.json, plot_path=args.plot)
    return 0
