"""The `static-decode` command line (also `python -m static_decode`).

Subcommands come from the modules named in `COMMAND_MODULES`, imported when the parser is built. A module
joins by defining `add_parser(subparsers) -> None`, which adds its parser(s) and sets `run=<fn(args) -> int>`
on each with `set_defaults`; a listed module that is missing, or lacks `add_parser`, raises. Building the parser
imports no compiler (torch._dynamo): the commands load what they run inside their `run`.

Under torchrun (WORLD_SIZE > 1, static_decode.commands.launch) commands that set `distributed=True` run on every rank
with `args.launch` telling them their rank, device and shard; the others refuse to start.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn, TextIO

COMMAND_MODULES: tuple[str, ...] = (
    "static_decode.commands.generate",
    "static_decode.commands.chat",
    "static_decode.commands.capture_report",
    "static_decode.commands.bench.command",
    "static_decode.commands.serve.command",
    "static_decode.commands.perplexity",
    "static_decode.commands.quantize",
)


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line and the --help hint (not the usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="static-decode", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:  # a missing module or one without add_parser raises: nothing is skipped
        importlib.import_module(name).add_parser(subparsers)
    return parser


# The exit status of a process ended by SIGINT (128 + 2), as shells report Ctrl-C.
INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; Ctrl-C anywhere (loading, capture, decoding) ends it with one line and status 130."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return _interrupted(argv)
    except Exception as e:
        if _interrupt_inside(e):  # Ctrl-C inside a library that wrapped it (an import inside torch.compile, say)
            return _interrupted(argv)
        raise


def _interrupt_inside(error: BaseException) -> bool:
    """Whether a KeyboardInterrupt is in `error`'s chain of causes and contexts (or dynamo's inner exception)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        todo += [e.__cause__, e.__context__, getattr(e, "inner_exception", None)]
    return False


def _interrupted(argv: Sequence[str] | None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    command = next((w for w in words if not w.startswith("-")), "")
    with contextlib.suppress(Exception):  # stdout may be a closed pipe
        sys.stdout.flush()
        if sys.stdout.isatty():  # end a half-written line of output before the message
            sys.stdout.write("\n")
            sys.stdout.flush()
    print(f"static-decode{' ' + command if command else ''}: interrupted", file=sys.stderr, flush=True)
    return INTERRUPTED


def _main(argv: Sequence[str] | None) -> int:
    from static_decode.commands import launch

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


# What an allocator says when it cannot hand out memory: CUDA's torch.OutOfMemoryError ("CUDA out of memory"),
# and the CPU allocator's plain RuntimeError ("DefaultCPUAllocator: can't allocate memory" / "not enough memory").
OOM_PHRASES = ("out of memory", "can't allocate memory", "not enough memory")


def _run(args: argparse.Namespace, stderr: TextIO, who: str) -> int:
    """Run the command; a user error or an allocation failure is one line on `stderr` and exit status 2."""
    try:
        return args.run(args)
    except (ValueError, TypeError, KeyError, FileNotFoundError) as e:
        if _interrupt_inside(e):
            raise
        message = _one_line(e)
    except RuntimeError as e:  # torch.OutOfMemoryError is one; any other RuntimeError is a bug: keep its traceback
        if not _out_of_memory(e):
            raise
        message = f"out of memory: {_one_line(e)} (try a smaller --max-len or batch, or --dtype bfloat16)"
    print(f"static-decode {args.command}{who}: error: {message}", file=stderr)
    return 2


def _out_of_memory(error: RuntimeError) -> bool:
    import torch  # loaded by every command already; not at module level, so building the parser stays light

    return isinstance(error, torch.OutOfMemoryError) or any(p in str(error).lower() for p in OOM_PHRASES)


def _one_line(error: BaseException) -> str:
    """The error's message on one line (some library messages span several); a KeyError without its quotes."""
    if isinstance(error, KeyError) and len(error.args) == 1 and isinstance(error.args[0], str):
        text = error.args[0]
    else:
        text = str(error)
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
