"""argparse types and argument checks shared by the commands."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from capture.settings import CaptureOptions
from static_decode.checkpoints.gguf import is_gguf
from static_decode.checkpoints.loading import load_model
from static_decode.checkpoints.sources import FORMS, resolve_model
from static_decode.model.llama import Llama
from static_decode.steps.functions import GREEDY_KINDS, SAMPLED_KINDS
from static_decode.steps.speculation import DEFAULT_NGRAM, DEFAULT_TOKENS, DraftModel, PromptLookup, Speculation
from static_decode.steps.verify import speculative_kinds

if TYPE_CHECKING:
    import torch


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    """Every usable core but one (at least one): see DEFAULT_THREADS_HELP."""
    return max(1, usable_cores() - 1)


# torch's own default (a thread per core) collapses when another process keeps a core busy: the threads meet at a
# barrier after every op, and each time one of them waits for the busy core. On the 2-vCPU EPYC, already shared with
# other work, eager SmolLM2-135M decoded at 560 ms/token with 1 thread against 1,514 with 2, and with one more busy
# process 1,126 against 2,019 (the embedded model: 8 against 99, 22 against 118). A core left free costs little on a
# quiet machine: there 1 thread was already as fast as 2 (profiles/RESULTS.md, "Tensor-parallel decode on the CPU").
DEFAULT_THREADS_HELP = "every core but one"


def positive_int(text: str) -> int:
    """An int >= 1 (--threads)."""
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from e
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """-t/--threads (every command that runs a model)."""
    p.add_argument("-t", "--threads", type=positive_int, default=None, metavar="N",
                   help="CPU threads for torch and the CPU kernels (default: OMP_NUM_THREADS when set, else "
                   f"{DEFAULT_THREADS_HELP})")


def apply_threads(args: argparse.Namespace) -> int:
    """Set torch's intra-op threads (the CPU kernels' at::parallel_for uses the same pool) from --threads or the
    default; return the count."""
    import torch

    threads = getattr(args, "threads", None)
    if threads is None:
        if os.environ.get("OMP_NUM_THREADS"):  # the user's own setting: torch has already taken it
            return torch.get_num_threads()
        threads = default_threads()
    torch.set_num_threads(threads)
    return threads


def check_checkpoint(path: Path, what: str = "--model") -> Path:
    """The checkpoint `path` names (static_decode.checkpoints.sources): a checkpoint directory (it holds
    config.json), a .gguf file, or a Hub id (org/name[@revision]) found in the local Hub cache; else an error naming
    what is missing: the directory, its config.json, the file, or the Hub model (and how to fetch it)."""
    if path.is_file() and not is_gguf(path):
        raise FileNotFoundError(f"no checkpoint at {path}: a file, not a .gguf file ({what} takes {FORMS})")
    try:
        resolved = resolve_model(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e} ({what})") from None
    if resolved.is_dir() and not (resolved / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {resolved} ({what}: a checkpoint directory holds config.json and "
                                "the weights)")
    return resolved


def check_output(flag: str, path: Path | None) -> None:
    """A file the command writes at its end, refused now in one line if it cannot be written (a directory, a missing
    or read-only folder): opened for appending once, and removed again if this made it."""
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory, not a file")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot be written ({e.strerror or e})") from None
    if not existed:
        path.unlink()


def check_written(flag: str, path: Path) -> None:
    """After a library wrote `path` (torch.profiler's export reports no failure): it must be there, not empty."""
    if not path.is_file() or path.stat().st_size == 0:
        raise ValueError(f"{flag} {path}: nothing was written")


def check_max_len(max_len: int | None) -> None:
    """--max-len, when given, is a cache length: 0 or less is refused (never read as "the default")."""
    if max_len is not None and max_len < 1:
        raise ValueError(f"--max-len must be >= 1 (or left out for the default), got {max_len}")


def add_text_arguments(p: argparse.ArgumentParser) -> None:
    """The options of what is printed and where a reply stops (generate, demo, chat)."""
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the output contains TEXT (not printed); repeatable")
    p.add_argument("--repeat-penalty", type=float, default=None, metavar="P",
                   help="divide the positive logits of tokens already seen by P, multiply the negative ones "
                   "(CTRL's / llama.cpp's penalty; default: off, 1.0; 1.1 is a common choice)")
    p.add_argument("--show-special", action="store_true",
                   help="print special tokens (e.g. <|im_end|>) instead of hiding them")


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated ints ("256,1024,4096"), e.g. --buckets, --contexts, --prompt-ids."""
    try:
        values = tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from e
    if not values:
        raise argparse.ArgumentTypeError("expected at least one int")
    return values


def capture_options(compile: bool, temperature: float, speculate: Speculation | None = None) -> CaptureOptions | None:
    """compile=True: capture only the kinds a request at this temperature runs (the sampling kinds compile slowly
    on the CPU), with the speculative ones of `speculate`; None otherwise."""
    if not compile:
        return None
    greedy = temperature == 0
    kinds = GREEDY_KINDS if greedy else SAMPLED_KINDS
    if speculate is not None:
        kinds = kinds + speculative_kinds(speculate, greedy)
    return CaptureOptions(kinds=kinds)


SPECULATE_FORMS = "prompt-lookup[:TOKENS[:NGRAM]] or draft[:TOKENS] (with --draft-model)"


def speculate_arg(text: str) -> tuple[str, int, int]:
    """--speculate: ("prompt-lookup", tokens, ngram) or ("draft", tokens, 0), e.g. "prompt-lookup:8:2"."""
    name, *nums = text.split(":")
    try:
        values = [int(n) for n in nums]
    except ValueError:
        values = None
    if name not in ("prompt-lookup", "draft") or values is None or len(values) > (2 if name == "prompt-lookup" else 1):
        raise argparse.ArgumentTypeError(f"expected {SPECULATE_FORMS}, got {text!r}")
    tokens = values[0] if values else DEFAULT_TOKENS
    ngram = values[1] if len(values) > 1 else DEFAULT_NGRAM if name == "prompt-lookup" else 0
    return name, tokens, ngram


def add_speculation_arguments(p: argparse.ArgumentParser) -> None:
    """--speculate and --draft-model (generate, demo, chat)."""
    p.add_argument("--speculate", type=speculate_arg, default=None,
                   help=f"speculative decoding: {SPECULATE_FORMS}; greedy output is unchanged")
    p.add_argument("--draft-model", type=Path, default=None,
                   help="checkpoint dir of a draft model (same vocabulary) for --speculate draft")


def speculation(args: argparse.Namespace, model: Llama) -> Speculation | None:
    """The Speculation of --speculate / --draft-model (loaded like the target: same device and dtype)."""
    choice, draft_path = getattr(args, "speculate", None), getattr(args, "draft_model", None)
    if draft_path is not None and choice is None:
        choice = speculate_arg("draft")
    if choice is None:
        return None
    name, tokens, ngram = choice
    if name == "prompt-lookup":
        if draft_path is not None:
            raise ValueError("--draft-model goes with --speculate draft[:TOKENS], not prompt-lookup")
        return PromptLookup(tokens=tokens, ngram=ngram)
    if draft_path is None:
        raise ValueError("--speculate draft needs --draft-model PATH (a checkpoint with the target's vocabulary)")
    check_checkpoint(draft_path, "--draft-model")
    draft = load_model(draft_path, dtype=model.dtype, device=model.device)
    return DraftModel(draft, tokens=tokens)



def add_quantize_argument(p: argparse.ArgumentParser) -> None:
    """--quantize (generate, demo, chat, serve, capture-report; bench takes several forms, its own option):
    weight-only int8 / int4 (static_decode.model.quant) or GGUF blocks (static_decode.model.gguf_quantize)."""
    from static_decode.model.quant import LOAD_CHOICES

    p.add_argument("--quantize", default=None, choices=LOAD_CHOICES,
                   help="weight-only quantization of every projection and the LM head: int8 (per output channel), "
                   "int4 (groups of 32; int4-g64 / int4-g128), or llama.cpp's blocks q4_k / q5_k / q6_k / q8_0")


def name_list(text: str) -> tuple[str, ...]:
    """Comma-separated names ("prefill,decode_greedy"), e.g. --kinds, --systems."""
    return tuple(t for t in text.replace(" ", "").split(",") if t)


def check_device(requested: str | None) -> torch.device:
    """The device of `--device` (None: cuda when available, else the CPU), or a one-line ValueError.

    Checked before a model is loaded, so that `--device cuda:7` on a one-GPU machine or `--device cuda` on a CPU
    build fails as one sentence naming the device and how many CUDA devices there are, rather than as a
    traceback out of torch's lazy CUDA init (an AssertionError) or its device-string parser (a RuntimeError).
    Not an argparse `type=`: argparse would print its usage block as well, and this check needs torch.
    """
    import torch

    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cuda = f"this machine has {count} CUDA device{'' if count == 1 else 's'}"
    if count == 0:
        cuda += " (no CUDA device is visible)" if torch.backends.cuda.is_built() else " (this torch build has no CUDA)"
    else:
        cuda += f", cuda:0..cuda:{count - 1}"
    try:
        device = torch.device(requested)
    except (RuntimeError, ValueError) as e:  # torch's own message lists twenty device types: not one line's worth
        raise ValueError(f"--device {requested!r} is not a torch device; use cpu, cuda or cuda:N; {cuda}") from e
    if device.type == "cuda":
        if count == 0 or (device.index is not None and device.index >= count):
            raise ValueError(f"--device {requested}: {cuda}" + ("; use --device cpu" if count == 0 else ""))
    elif device.type == "meta":
        raise ValueError(f"--device {requested}: meta tensors hold no data; use cpu or cuda; {cuda}")
    elif device.type != "cpu":  # mps, xpu, ...: usable only if this build and machine have the backend
        try:
            torch.empty(0, device=device)
        except Exception as e:  # AssertionError, NotImplementedError, ModuleNotFoundError, RuntimeError, ...
            raise ValueError(
                f"--device {requested}: this torch build or machine cannot use {device.type} devices; "
                f"use cpu or cuda; {cuda}"
            ) from e
    return device
