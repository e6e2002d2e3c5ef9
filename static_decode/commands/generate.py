"""`static-decode generate` and `static-decode demo`: load a checkpoint, stream one prompt's new tokens."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from static_decode.checkpoints.loading import default_model_path, load_chat_template, load_model, load_tokenizer
from static_decode.commands.args import (
    add_quantize_argument,
    add_speculation_arguments,
    add_text_arguments,
    add_threads_argument,
    apply_threads,
    capture_options,
    check_checkpoint,
    check_device,
    check_max_len,
    check_output,
    check_written,
    int_list,
    speculation,
)
from static_decode.commands.chat_options import add_chat_template_arguments
from static_decode.commands.samplers import add_sampler_arguments, check_sampler_flags, sampler_options
from static_decode.commands.streaming import write_stream
from static_decode.commands.structured_flags import (
    add_structured_arguments,
    compile_grammar,
    grammar_tables,
    read_schema,
    without_eos,
)
from static_decode.generation.generator import DEFAULT_CHUNK_SIZE, DEFAULT_READ_EVERY, Generator
from static_decode.generation.stats import GenerationStats

DEMO_PROMPT = "def "
# What `demo` says first: its output is not meant to answer anything.
DEMO_NOTE = ("demo: the embedded model is a toy byte-level model trained on Python's standard library; it writes "
             "Python-looking text, not answers (use --model DIR for a real model)")


def add_generation_arguments(p: argparse.ArgumentParser, *, demo: bool = False) -> None:
    """The options shared by `generate` and `demo` (demo has its own defaults and no --model)."""
    if not demo:
        p.add_argument("--model", type=Path, default=None,
                       help="checkpoint dir, .gguf file or Hub id org/name[@revision] (default: embedded model)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=DEMO_PROMPT if demo else None, help="text (needs tokenizer.json)")
    prompt.add_argument("--prompt-ids", type=int_list, default=None, help="prompt token ids, e.g. 1,2,3")
    prompt.add_argument("-f", "--prompt-file", type=Path, default=None, metavar="FILE",
                        help="read the prompt text from FILE ('-': standard input)")
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
    add_quantize_argument(p)
    p.add_argument("--kv-dtype", default=None, choices=("float32", "bfloat16", "float16", "int8"),
                   help="the K/V cache's dtype (default: the model's); a 16-bit cache halves long-context reads, "
                   "int8 (a float32 scale per token and KV head) about halves a 16-bit cache's")
    p.add_argument("--profile", type=Path, default=None, help="write a torch.profiler Chrome trace of the run here")
    add_speculation_arguments(p)
    add_text_arguments(p)
    add_sampler_arguments(p)
    add_structured_arguments(p)
    add_threads_argument(p)
    if not demo:
        p.add_argument("--chat", action="store_true", help="render --prompt as one user message of the chat template")
        p.add_argument("--system", default=None, metavar="TEXT",
                       help="a system message before the prompt (renders the chat template: implies --chat)")
        add_chat_template_arguments(p, what="--chat")


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


class _Clock:
    """Times a token stream as the host sees it (for a stream closed early, which records no statistics)."""

    def __init__(self, tokens: Iterator[int]) -> None:
        self.tokens, self.times = tokens, []

    def __iter__(self) -> Iterator[int]:
        self.start = time.perf_counter()
        try:
            for t in self.tokens:
                self.times.append(time.perf_counter())
                yield t
        finally:
            close = getattr(self.tokens, "close", None)
            if close is not None:
                close()

    def stats(self, prompt_tokens: int) -> GenerationStats:
        n = len(self.times)
        first, last = (self.times[0], self.times[-1]) if n else (self.start, self.start)
        return GenerationStats(prompt_tokens=prompt_tokens, new_tokens=n, prefill_s=first - self.start,
                               decode_s=last - first, decode_steps=max(n - 1, 0))


def _prompt_text(args: argparse.Namespace) -> str | None:
    """--prompt, or the text of --prompt-file ('-': stdin)."""
    path = getattr(args, "prompt_file", None)
    if path is None:
        return args.prompt
    if str(path) == "-":
        return sys.stdin.read()
    if not path.is_file():
        raise FileNotFoundError(f"--prompt-file {path}: no such file")
    return path.read_text(encoding="utf-8")


def run_generate(args: argparse.Namespace) -> int:
    """Load, generate one prompt (streaming the output), print a timing summary on stderr."""
    from static_decode.model.parallel import SINGLE

    if args.max_new_tokens < 1:  # checked first: the default max_len is derived from it
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_max_len(args.max_len)
    check_sampler_flags(args, speculating=False)  # with --speculate the generator says which it refuses
    check_output("--profile", getattr(args, "profile", None))
    schema = read_schema(args)  # --json-schema FILE / --json-object, checked before anything loads
    launch = getattr(args, "launch", None)  # set under torchrun: this rank's shard and device
    if launch is None or args.threads is not None:  # under torchrun the launcher shares the cores by default
        apply_threads(args)
    # A device this machine lacks fails here, before any file is read (under torchrun launch picked it already).
    device = launch.device if launch is not None else check_device(args.device)
    path = getattr(args, "model", None)
    if path is None:
        path = default_model_path()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {path} (the embedded default model is not built yet)")
    path = check_checkpoint(path)
    demo = getattr(args, "command", None) == "demo"
    if demo:
        print(DEMO_NOTE, file=sys.stderr)
    system = getattr(args, "system", None)
    chat = getattr(args, "chat", False) or system is not None  # demo has neither
    template_kwargs = getattr(args, "chat_template_kwargs", None)
    if template_kwargs is not None and not chat:
        raise ValueError("--chat-template-kwargs are variables of the chat template: give --chat (or --system)")
    text = _prompt_text(args)
    t0 = time.perf_counter()
    tp = launch.tp if launch is not None else SINGLE
    model = load_model(path, dtype=args.dtype, device=device, tp=tp, quantize=args.quantize)
    model.kv_dtype = getattr(args, "kv_dtype", None)
    tokenizer = load_tokenizer(path)
    if args.prompt_ids is not None:
        if chat:
            raise ValueError("--chat (and --system) render --prompt TEXT with the chat template; they do not take "
                             "--prompt-ids")
        prompt = list(args.prompt_ids)
    elif text is not None:
        if tokenizer is None:
            raise ValueError(f"--prompt needs a tokenizer.json in {path}; pass --prompt-ids instead")
        if chat:  # one user message, rendered with the checkpoint's chat template
            template = load_chat_template(path)
            if template is None:
                raise ValueError(f"--chat needs a chat template (chat_template.jinja or tokenizer_config.json's "
                                 f"chat_template) in {path}")
            messages = [] if system is None else [{"role": "system", "content": system}]
            text = template.render([*messages, {"role": "user", "content": text}], add_generation_prompt=True,
                                   kwargs=template_kwargs)
        prompt = tokenizer.encode(text, add_special_tokens=not chat).ids  # a template writes its own BOS
    else:
        raise ValueError("give --prompt TEXT, --prompt-file FILE or --prompt-ids 1,2,3")
    if args.stop and tokenizer is None:
        raise ValueError(f"--stop needs a tokenizer.json in {path} (it matches text)")
    spec = speculation(args, model)
    max_len = args.max_len if args.max_len is not None else (
        len(prompt) + args.max_new_tokens + (0 if spec is None else spec.tokens))
    capture = capture_options(args.compile, args.temperature, spec)
    t1 = time.perf_counter()
    # batch=1: the cache is allocated (and with --compile every step captured) here, timed as the capture
    gen = Generator(
        model, max_len=max_len, chunk_size=args.chunk_size, long_chunk=args.long_chunk, compile=args.compile,
        capture=capture, speculate=spec, batch=1, grammar_tables=grammar_tables(args),
    )
    t2 = time.perf_counter()
    grammar = compile_grammar(args, schema, tokenizer, model.config.vocab_size, gen.eos_token_ids)
    tokens = gen.stream(
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        read_every=args.read_every,
        repeat_penalty=args.repeat_penalty,
        grammar=grammar,
        **sampler_options(args),
    )
    clock = _Clock(tokens)
    tokens = iter(clock)
    out = sys.stdout
    prof = _start_profiler(getattr(args, "profile", None))  # the stream is lazy: prefill runs in the loop below
    stopped = False
    if tokenizer is None:
        out.write(f"prompt ids: {','.join(map(str, prompt))}\nnew ids:")
        for t in tokens:
            out.write(f" {t}")
            out.flush()
    else:
        skip = not args.show_special
        if not chat and grammar is None:  # a chat prompt is the rendered template, JSON is for a parser: the reply
            out.write(tokenizer.decode(prompt, skip_special_tokens=skip))
        if grammar is not None:
            tokens = without_eos(tokens, gen.eos_token_ids)
        stopped = write_stream(tokenizer, tokens, out, skip_special_tokens=skip, stops=args.stop).stopped
    out.write("\n")
    out.flush()
    if prof is not None:
        prof.stop()
        prof.export_chrome_trace(str(args.profile))
        check_written("--profile", args.profile)
        print(f"torch.profiler Chrome trace: {args.profile}", file=sys.stderr)
    where = "" if not tp.enabled else f" [{tp.describe()}, {launch.backend}]"
    load, capture_s = (t1 - t0, t2 - t1) if args.compile else (t2 - t0, None)
    stats = clock.stats(len(prompt)) if stopped else gen.stats  # a closed stream leaves no request statistics
    tail = ", stopped at a --stop string" if stopped else ""
    print(stats.summary(load_s=load, capture_s=capture_s) + tail + where, file=sys.stderr)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """This module's commands: `generate` and `demo`."""
    p = subparsers.add_parser("generate", help="generate from a prompt with a checkpoint")
    add_generation_arguments(p)
    p.set_defaults(run=run_generate, distributed=True)
    p = subparsers.add_parser("demo", help=f"generate from {DEMO_PROMPT!r} with the embedded model")
    add_generation_arguments(p, demo=True)
    p.set_defaults(run=run_generate, distributed=True)
