"""The `static-decode` command line (also `python -m static_decode`).

Subcommands come from the modules named in `COMMAND_MODULES`, imported when the parser is built. A module
joins by defining `add_parser(subparsers) -> None`, which adds its parser(s) and sets `run=<fn(args) -> int>`
on each with `set_defaults`. This module defines `generate` and `demo`. A listed module that does not exist
(or does not define `add_parser` yet) adds nothing; any other import error is raised.

Under torchrun (WORLD_SIZE > 1, static_decode.launch) commands that set `distributed=True` run on every rank
with `args.launch` telling them their rank, device and shard; the others refuse to start.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TextIO

from static_decode.generator import DEFAULT_CHUNK_SIZE, DEFAULT_READ_EVERY

COMMAND_MODULES: tuple[str, ...] = ("static_decode.cli", "capture.report", "static_decode.bench")
DEMO_PROMPT = "def "


def default_model_path() -> Path:
    """The embedded default checkpoint shipped inside the package."""
    return Path(str(resources.files("static_decode") / "default_model"))


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated ints, got {text!r}") from e
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def add_generation_arguments(p: argparse.ArgumentParser, *, demo: bool = False) -> None:
    """The options shared by `generate` and `demo` (demo has its own defaults and no --model)."""
    if not demo:
        p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: embedded model)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=DEMO_PROMPT if demo else None, help="text (needs tokenizer.json)")
    prompt.add_argument("--prompt-ids", type=_prompt_ids, default=None, help="prompt token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=200 if demo else 64, help="most tokens to generate")
    p.add_argument("--max-len", type=int, default=None, help="cache length (default: prompt + new)")
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="prompt slots per prefill step")
    p.add_argument("--read-every", type=int, default=DEFAULT_READ_EVERY, help="decode steps per read-back")
    p.add_argument("--temperature", type=float, default=0.8 if demo else 0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=0.95 if demo else None, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=0 if demo else None, help="sampling seed (reproducible)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False, help="compile the steps")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--profile", type=Path, default=None, help="write a torch.profiler Chrome trace of the run here")


def _start_profiler(path: Path | None):  # -> torch.profiler.profile | None
    """A running torch.profiler (CPU, and CUDA when present) when `path` is given."""
    if path is None:
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, record_shapes=True)
    prof.start()
    return prof


def run_generate(args: argparse.Namespace) -> int:
    """Load, generate one prompt (streaming the output), print a timing summary on stderr."""
    import torch

    from static_decode.generator import Generator
    from static_decode.loading import load_model, load_tokenizer
    from static_decode.parallel import SINGLE

    if args.max_new_tokens < 1:  # checked first: the default max_len is derived from it
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    path = getattr(args, "model", None) or default_model_path()
    if not (path / "config.json").is_file():
        hint = " (the embedded default model is not built yet)" if path == default_model_path() else ""
        raise FileNotFoundError(f"no checkpoint at {path}{hint}")
    launch = getattr(args, "launch", None)  # set under torchrun: this rank's shard and device
    if launch is not None:
        tp, device = launch.tp, launch.device
    else:
        tp, device = SINGLE, torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_model(path, dtype=args.dtype, device=device, tp=tp)
    tokenizer = load_tokenizer(path)
    if args.prompt_ids is not None:
        prompt = args.prompt_ids
    elif args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"--prompt needs a tokenizer.json in {path}; pass --prompt-ids instead")
        prompt = tokenizer.encode(args.prompt).ids
    else:
        raise ValueError("give --prompt TEXT or --prompt-ids 1,2,3")
    max_len = args.max_len or len(prompt) + args.max_new_tokens
    capture = None
    if args.compile:  # capture only the kinds this request runs (the sampling kinds compile slowly on CPU)
        from capture import CaptureOptions

        greedy = args.temperature == 0
        kinds = ("prefill", "first_greedy", "decode_greedy") if greedy else ("prefill", "first", "decode")
        capture = CaptureOptions(kinds=kinds)
    gen = Generator(model, max_len=max_len, chunk_size=args.chunk_size, compile=args.compile, capture=capture)
    tokens = gen.stream(
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        read_every=args.read_every,
    )
    out = sys.stdout
    prof = _start_profiler(getattr(args, "profile", None))  # the stream is lazy: prefill runs in the loop below
    if tokenizer is None:
        out.write(f"prompt ids: {','.join(map(str, prompt))}\nnew ids:")
        for t in tokens:
            out.write(f" {t}")
            out.flush()
    else:
        out.write(tokenizer.decode(prompt))
        ids: list[int] = []
        shown = ""
        for t in tokens:
            ids.append(t)
            text = tokenizer.decode(ids)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                out.write(text[len(shown) :])
                out.flush()
                shown = text
        out.write(tokenizer.decode(ids)[len(shown) :])
    out.write("\n")
    out.flush()
    if prof is not None:
        prof.stop()
        prof.export_chrome_trace(str(args.profile))
        print(f"torch.profiler Chrome trace: {args.profile}", file=sys.stderr)
    where = "" if not tp.enabled else f" [{tp.describe()}, {launch.backend}]"
    print(gen.stats.summary() + where, file=sys.stderr)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """This module's commands: `generate` and `demo`."""
    p = subparsers.add_parser("generate", help="generate from a prompt with a checkpoint")
    add_generation_arguments(p)
    p.set_defaults(run=run_generate, distributed=True)
    p = subparsers.add_parser("demo", help=f"generate from {DEMO_PROMPT!r} with the embedded model")
    add_generation_arguments(p, demo=True)
    p.set_defaults(run=run_generate, distributed=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="static-decode", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and (name == e.name or name.startswith(e.name + ".")):  # not there yet
                continue
            raise
        add = getattr(module, "add_parser", None)
        if add is not None:
            add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from static_decode import launch

    args = build_parser().parse_args(argv)
    try:
        env = launch.distributed_env()
    except ValueError as e:
        print(f"static-decode {args.command}: error: {e}", file=sys.stderr)
        return 2
    if env is None:
        return _run(args, sys.stderr, "")
    if not getattr(args, "distributed", False):
        print(
            f"static-decode {args.command}: error: this command does not run under torchrun "
            f"(WORLD_SIZE={env[1]}); run it as a single process",
            file=sys.stderr,
        )
        return 2
    with contextlib.ExitStack() as stack:
        try:
            where = stack.enter_context(launch.session(getattr(args, "device", None)))
        except ValueError as e:  # a device this rank cannot have
            print(f"static-decode {args.command} [rank {env[0]}]: error: {e}", file=sys.stderr)
            return 2
        args.launch = where
        return _run(args, where.stderr, f" [rank {where.tp.rank}]")


def _run(args: argparse.Namespace, stderr: TextIO, who: str) -> int:
    try:
        return args.run(args)
    except (ValueError, TypeError, KeyError, FileNotFoundError) as e:
        print(f"static-decode {args.command}{who}: error: {e}", file=stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
