"""`static-decode generate` and `static-decode demo`: load a checkpoint, stream one prompt's new tokens."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from static_decode.chat_template import load_chat_template
from static_decode.commands.args import add_speculation_arguments, capture_options, check_device, int_list, speculation
from static_decode.commands.streaming import write_stream
from static_decode.generator import DEFAULT_CHUNK_SIZE, DEFAULT_READ_EVERY, Generator
from static_decode.loading import default_model_path, load_model, load_tokenizer

DEMO_PROMPT = "def "


def add_generation_arguments(p: argparse.ArgumentParser, *, demo: bool = False) -> None:
    """The options shared by `generate` and `demo` (demo has its own defaults and no --model)."""
    if not demo:
        p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: embedded model)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=DEMO_PROMPT if demo else None, help="text (needs tokenizer.json)")
    prompt.add_argument("--prompt-ids", type=int_list, default=None, help="prompt token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=200 if demo else 64, help="most tokens to generate")
    p.add_argument("--max-len", type=int, default=None, help="cache length (default: prompt + new)")
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="prompt slots per prefill step")
    p.add_argument("--long-chunk", type=int, default=None,
                   help="slots of an uncompiled long prefill step, used while a prompt has that many left "
                   "(default: 512 when larger than --chunk-size; 0 = off)")
    p.add_argument("--read-every", type=int, default=DEFAULT_READ_EVERY, help="decode steps per read-back")
    p.add_argument("--temperature", type=float, default=0.8 if demo else 0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=0.95 if demo else None, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=0 if demo else None, help="sampling seed (reproducible)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False, help="compile the steps")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--kv-dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="the K/V cache's dtype (default: the model's); a 16-bit cache halves long-context reads")
    p.add_argument("--profile", type=Path, default=None, help="write a torch.profiler Chrome trace of the run here")
    add_speculation_arguments(p)
    if not demo:
        p.add_argument("--chat", action="store_true", help="render --prompt as one user message of the chat template")


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
    from static_decode.parallel import SINGLE

    if args.max_new_tokens < 1:  # checked first: the default max_len is derived from it
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    launch = getattr(args, "launch", None)  # set under torchrun: this rank's shard and device
    # A device this machine lacks fails here, before any file is read (under torchrun launch picked it already).
    device = launch.device if launch is not None else check_device(args.device)
    path = getattr(args, "model", None) or default_model_path()
    if not (path / "config.json").is_file():
        hint = " (the embedded default model is not built yet)" if path == default_model_path() else ""
        raise FileNotFoundError(f"no checkpoint at {path}{hint}")
    tp = launch.tp if launch is not None else SINGLE
    model = load_model(path, dtype=args.dtype, device=device, tp=tp)
    model.kv_dtype = getattr(args, "kv_dtype", None)
    tokenizer = load_tokenizer(path)
    chat = getattr(args, "chat", False)  # demo has no --chat
    if args.prompt_ids is not None:
        if chat:
            raise ValueError("--chat renders --prompt TEXT with the chat template; it does not take --prompt-ids")
        prompt = list(args.prompt_ids)
    elif args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"--prompt needs a tokenizer.json in {path}; pass --prompt-ids instead")
        text = args.prompt
        if chat:  # one user message, rendered with the checkpoint's chat template
            template = load_chat_template(path)
            if template is None:
                raise ValueError(f"--chat needs a chat template (chat_template.jinja or tokenizer_config.json's "
                                 f"chat_template) in {path}")
            text = template.render([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        prompt = tokenizer.encode(text, add_special_tokens=not chat).ids  # a template writes its own BOS
    else:
        raise ValueError("give --prompt TEXT or --prompt-ids 1,2,3")
    spec = speculation(args, model)
    max_len = args.max_len or len(prompt) + args.max_new_tokens + (0 if spec is None else spec.tokens)
    capture = capture_options(args.compile, args.temperature, spec)
    gen = Generator(
        model, max_len=max_len, chunk_size=args.chunk_size, long_chunk=args.long_chunk, compile=args.compile,
        capture=capture, speculate=spec,
    )
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
        if not chat:  # a chat prompt is the rendered template: show only the reply
            out.write(tokenizer.decode(prompt))
        write_stream(tokenizer, tokens, out)
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
