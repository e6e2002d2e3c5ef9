"""`static-decode serve --model DIR`: an OpenAI-compatible HTTP server for single-stream decode.

    static-decode serve --model DIR [--host 127.0.0.1] [--port 8000] [--compile] [--max-len N] [--queue N]
                        [--quantize int8|int4] [-t N] [--speculate ...] [--structured] [sampling defaults]

It loads the checkpoint, builds the generator (batch 1) and, with --compile, captures the steps of greedy and
sampled requests (--capture-kinds) before it listens, so the first request is as fast as the rest; then it prints
one line with the address. Requests decode one at a time in arrival order (static_decode.commands.serve.worker);
a request whose prompt starts with tokens the cache holds from the previous request prefills only the rest
(static_decode.generation.prefix_cache). SIGINT or SIGTERM stops it within a second: new requests are refused, the
running one stops at its next read-back and every open request gets an answer. Starlette on uvicorn (the `serve`
extra), not FastAPI: docs/internals.md#serve.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from static_decode.checkpoints.loading import default_model_path, load_chat_template, load_model, load_tokenizer
from static_decode.commands.args import (
    add_quantize_argument,
    add_speculation_arguments,
    add_threads_argument,
    apply_threads,
    check_checkpoint,
    check_device,
    speculation,
)
from static_decode.commands.chat_options import add_chat_template_arguments
from static_decode.commands.samplers import add_sampler_arguments, check_sampler_flags, sampler_options
from static_decode.commands.serve.messages import REASONING_FORMATS
from static_decode.generation.generator import DEFAULT_CHUNK_SIZE, DEFAULT_READ_EVERY, Generator
from static_decode.generation.request import SamplingParams

DEFAULT_MAX_LEN = 4096  # cache positions per request (capped by the model's own limit)
DEFAULT_QUEUE = 16  # requests that may wait behind the running one


def _check_args(args: argparse.Namespace) -> None:
    if args.queue < 0:
        raise ValueError(f"--queue must be >= 0, got {args.queue}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    # the defaults a request may rely on, checked as the generator checks a request's own values (now, not at
    # every request that leaves them out)
    flags = {"temperature": args.temperature, "top_k": args.top_k or None, "top_p": args.top_p, "seed": args.seed,
             "repeat_penalty": args.repeat_penalty}
    for name, value in flags.items():
        try:
            SamplingParams(**{name: value})
        except (ValueError, TypeError) as e:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: {e}") from None
    speculating = getattr(args, "speculate", None) is not None or getattr(args, "draft_model", None) is not None
    check_sampler_flags(args, speculating)  # --min-p, the penalties, --logit-bias (and --repeat-penalty speculating)
    if args.structured and speculating:
        raise ValueError("--structured (response_format) is not supported with speculative decoding (--speculate)")


def _check_grammar_libraries() -> None:
    try:
        import outlines_core  # noqa: F401
        import xgrammar  # noqa: F401
    except ModuleNotFoundError as e:
        raise ValueError(f"--structured needs outlines-core and xgrammar (the [grammar] extra; {e.name} is missing): "
                         "pip install 'static-decode[grammar]'") from e


def build(args: argparse.Namespace):  # -> tuple[Served, Generator]
    """Load the model and tokenizer, build and warm the generator, start the worker: everything but the HTTP
    server. Returns the app's `Served`."""
    from capture.settings import CaptureOptions
    from static_decode.commands.serve.api import Context, Sampling
    from static_decode.commands.serve.app import Served
    from static_decode.commands.serve.structured import GrammarCache
    from static_decode.commands.serve.worker import Worker
    from static_decode.generation.prefix_cache import PrefixCache
    from static_decode.generation.scoring import MAX_LOGPROBS
    from static_decode.generation.structured import DEFAULT_GRAMMAR_TABLES
    from static_decode.steps.functions import GREEDY_KINDS, SAMPLED_KINDS
    from static_decode.steps.verify import speculative_kinds

    device = check_device(args.device)
    path = check_checkpoint(args.model or default_model_path())
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"serve needs a tokenizer.json in {path}")
    template = load_chat_template(path)  # None: /v1/chat/completions refuses, /v1/completions works
    if template is None and args.chat_template_kwargs is not None:
        raise ValueError(f"--chat-template-kwargs: {path} has no chat template to pass them to")
    if args.metrics:
        try:
            import prometheus_client  # noqa: F401
        except ModuleNotFoundError as e:
            raise ValueError("--metrics needs prometheus-client (the [serve] extra): pip install "
                             "'static-decode[serve]'") from e
    if args.structured:
        _check_grammar_libraries()
    apply_threads(args)
    model = load_model(path, dtype=args.dtype, device=device, quantize=args.quantize)
    check_sampler_flags(args, False, model.config.vocab_size)  # --logit-bias ids in this vocabulary
    model.kv_dtype = args.kv_dtype
    max_len = args.max_len or min(DEFAULT_MAX_LEN, model.config.max_position_embeddings)
    spec = speculation(args, model)
    capture = None
    if args.compile:  # the kinds of the temperatures served (--capture-kinds), captured before listening
        greedy = [True, False] if args.capture_kinds == "all" else [args.capture_kinds == "greedy"]
        kinds: tuple[str, ...] = ()
        for g in greedy:
            kinds += (GREEDY_KINDS if g else SAMPLED_KINDS) + (() if spec is None else speculative_kinds(spec, g))
        capture = CaptureOptions(kinds=tuple(dict.fromkeys(kinds)))
    gen = Generator(model, max_len=max_len, chunk_size=args.chunk_size, long_chunk=args.long_chunk, batch=1,
                    compile=args.compile, capture=capture, read_every=args.read_every, speculate=spec,
                    max_logprobs=MAX_LOGPROBS,  # a request's logprobs / top_logprobs, up to OpenAI's 20
                    grammar_tables=DEFAULT_GRAMMAR_TABLES if args.structured else None)
    if args.compile:
        gen.warm_up(capture.kinds, progress=True)
    else:  # the first request's one-time costs (kernels' first calls, allocator) paid here
        gen.generate([0], 2, stop_at_eos=False)
    defaults = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                        repeat_penalty=args.repeat_penalty, max_tokens=args.max_tokens, **sampler_options(args))
    grammars = GrammarCache(tokenizer, model.config.vocab_size, gen.eos_token_ids) if args.structured else None
    ctx = Context(model_name=args.model_name or path.resolve().name, tokenizer=tokenizer, template=template,
                  vocab_size=model.config.vocab_size, max_len=max_len, draft_slots=gen.draft_slots,
                  defaults=defaults, template_kwargs=args.chat_template_kwargs or {},
                  reasoning_format=args.reasoning_format, grammars=grammars)
    worker = Worker(PrefixCache(gen), tokenizer, args.queue)
    metrics = None
    if args.metrics:
        from static_decode.commands.serve.app import ROUTES
        from static_decode.commands.serve.metrics import Metrics

        metrics = Metrics(lambda: worker.waiting, (*(r.path for r in ROUTES), "/metrics"))
    return Served(ctx=ctx, worker=worker, created=int(time.time()), metrics=metrics)


def run_serve(args: argparse.Namespace) -> int:
    """Load and warm up, listen, serve until SIGINT/SIGTERM."""
    try:
        import uvicorn
        from starlette.applications import Starlette  # noqa: F401
    except ModuleNotFoundError as e:
        raise ValueError(f"serve needs the [serve] extra ({e.name} is missing): pip install "
                         "'static-decode[serve]'") from e
    from static_decode.commands.serve.app import build_app

    _check_args(args)
    served = build(args)
    worker = served.worker

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:  # type: ignore[override]
            await super().startup(sockets)
            if self.started:  # listening now: the one line a caller waits for
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(f"static-decode serve: {served.ctx.model_name} on http://{host}:{port} "
                      f"(max_len {served.ctx.max_len}, queue {worker.queue_size})", flush=True)

        def handle_exit(self, sig: int, frame: object) -> None:
            # Refuse new requests and cancel the open ones (the running one at its next read-back): their
            # responses end now, so the graceful shutdown below waits for nothing. Unlike uvicorn's own handler
            # the signal is not raised again afterwards: a stop on request is a clean exit (status 0).
            worker.close(timeout=0)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting for connections
            self.should_exit = True

    config = uvicorn.Config(build_app(served), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.log_level in ("info", "debug", "trace"), timeout_graceful_shutdown=1,
                            lifespan="off")
    Server(config).run()
    worker.close(timeout=0.5)  # the decode thread ends at its next read-back (a long prefill: not waited for)
    # Every request is answered and nothing is left to write: end here rather than in the interpreter's teardown
    # (torch's takes 1-3 s on a busy machine), so that a stop takes well under a second.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `serve` with the static-decode CLI (static_decode/commands/cli.py's COMMAND_MODULES)."""
    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (single-stream decode, prefix reuse)")
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint dir, .gguf file or Hub id org/name[@rev], with a tokenizer (default: embedded)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--queue", type=int, default=DEFAULT_QUEUE,
                   help="requests that may wait behind the running one (more are refused with 429)")
    p.add_argument("--max-len", type=int, default=None, help=f"cache positions per request, prompt and reply "
                   f"(default: {DEFAULT_MAX_LEN}, or the model's limit if smaller)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens when a request gives no max_tokens (default: up to --max-len)")
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="prompt slots per prefill step")
    p.add_argument("--long-chunk", type=int, default=None,
                   help="slots of an uncompiled long prefill step (default: 512 when larger than --chunk-size)")
    p.add_argument("--read-every", type=int, default=DEFAULT_READ_EVERY,
                   help="decode steps per read-back (how often text is sent and a disconnect is noticed)")
    p.add_argument("--temperature", type=float, default=0.0, help="default when a request gives none; 0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="default top_k (0 = off)")
    p.add_argument("--top-p", type=float, default=None, help="default top_p")
    p.add_argument("--seed", type=int, default=None, help="default sampling seed")
    p.add_argument("--repeat-penalty", type=float, default=None, help="default repeat_penalty (1 = off)")
    add_sampler_arguments(p, default="default ")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False, help="compile the steps")
    p.add_argument("--capture-kinds", default="all", choices=("all", "greedy", "sampled"),
                   help="with --compile: capture the steps of greedy requests, sampled ones or both before listening "
                   "(the others compile at their first request)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--kv-dtype", default=None, choices=("float32", "bfloat16", "float16", "int8"),
                   help="the K/V cache's dtype (default: the model's; int8: codes and a float32 scale per token)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (info: one line per request)")
    add_chat_template_arguments(p, what="every chat request (a request's chat_template_kwargs go over them)")
    p.add_argument("--reasoning-format", default="none", choices=REASONING_FORMATS,
                   help="deepseek: a chat reply's <think> span is returned as message.reasoning_content (streamed as "
                   "delta.reasoning_content) and removed from content; none: left in content (a request's "
                   "reasoning_format goes over it)")
    p.add_argument("--metrics", action="store_true",
                   help="Prometheus metrics at GET /metrics (request counts, queue depth, prefill and per-token time)")
    p.add_argument("--structured", action="store_true",
                   help="honour response_format json_object / json_schema (grammar tables on the device: about 4 MiB, "
                   "and a mask per decode step for every request)")
    add_quantize_argument(p)
    add_threads_argument(p)
    add_speculation_arguments(p)
    p.set_defaults(run=run_serve)
