"""`static-decode chat --model PATH`: an interactive multi-turn chat that keeps the conversation in the cache.

Each line on stdin is a user message; the reply streams to stdout, one reply per turn, and a line of numbers per
turn goes to stderr. `/reset` starts over; end of input (Ctrl-D) ends the session. The conversation is rendered
with the checkpoint's chat template at every turn, and only what is new since the cached tokens is fed: when the
rendered text starts with the text of the cached tokens, the rest is tokenized and appended (the previous reply's
tokens stay exactly as the model produced them); otherwise (a template that rewrites earlier turns) the whole
rendering is prefilled again, and the stderr line says so. `--system TEXT` opens every conversation with a system
message; `--stop TEXT` cuts a reply at TEXT (the conversation keeps the reply as shown, and the next turn prefills
the whole rendering again, since the cache held the cut tokens).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from static_decode.generation.conversation import Conversation
from static_decode.generation.generator import DEFAULT_CHUNK_SIZE, Generator
from static_decode.text.chat_template import ChatTemplate

DEFAULT_MAX_LEN = 4096  # cache positions for the whole conversation (capped by the model's own limit)


class ChatSession:
    """Messages, their rendering, and the conversation on the generator's cache."""

    def __init__(self, gen: Generator, tokenizer: Any, template: ChatTemplate, system: str | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        self.template_kwargs = template_kwargs  # --chat-template-kwargs, at every rendering
        self.conv = Conversation(gen)
        self.tokenizer, self.template = tokenizer, template
        self.opening = [] if system is None else [{"role": "system", "content": system}]
        self.messages: list[dict[str, str]] = list(self.opening)
        self.reused = False  # whether the last turn appended to the cached conversation
        self.rescan = ""  # why the last turn prefilled the whole conversation again ("": it did not, or turn 1)
        self._was_cut = False  # the previous reply was cut by a stop string (the cache no longer holds it)
        self.turns = 0  # turns taken since the start or the last /reset

    def reset(self) -> None:
        self.conv.reset()
        self.messages = list(self.opening)
        self._was_cut = False
        self.turns = 0

    def cut(self, text: str, shown: str) -> None:
        """The reply to `text` stopped early at a stop string, `shown` being what was printed: the conversation
        keeps it as the reply, and the next turn renders everything again (the abandoned turn reset the cache)."""
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": shown}]
        self.conv.reset()
        self.turns += 1
        self._was_cut = True

    def turn_ids(self, text: str) -> list[int]:
        """The tokens to feed for user message `text`: the rendering's part past what is cached."""
        rendered = self.template.render([*self.messages, {"role": "user", "content": text}],
                                        kwargs=self.template_kwargs)
        cached = self.tokenizer.decode(self.conv.tokens, skip_special_tokens=False) if self.conv.tokens else ""
        self.reused = bool(cached) and rendered.startswith(cached)
        earlier = len(self.messages) > len(self.opening)
        self.rescan = ("" if self.reused or not earlier else "a stop string cut the last reply" if self._was_cut
                       else "the template changed earlier turns")
        self._was_cut = False
        if not self.reused:
            self.conv.reset()
        delta = rendered[len(cached) :] if self.reused else rendered
        return self.tokenizer.encode(delta, add_special_tokens=False).ids  # a template writes its own BOS

    def send(self, text: str, max_new_tokens: int, **sampling: Any) -> Iterator[int]:
        """Stream the reply to user message `text`; the messages are updated when it is complete."""
        ids = self.turn_ids(text)
        tokens = self.conv.send(ids, max_new_tokens, **sampling)
        reply: list[int] = []
        try:
            for t in tokens:
                reply.append(t)
                yield t
        finally:  # closed early (a stop string): the conversation's turn is abandoned now, not at garbage collection
            tokens.close()
        self.turns += 1
        self.messages += [{"role": "user", "content": text},
                          {"role": "assistant", "content": self.tokenizer.decode(reply, skip_special_tokens=True)}]


def read_line(stream: Any) -> tuple[str, str]:
    """The next line of `stream` ("" at its end) and why it cannot be a message ("": it can). The bytes are decoded
    here, strictly, so a line that is not UTF-8 is refused alone, whatever the locale's stdin errors handler."""
    raw = getattr(stream, "buffer", None)
    if raw is None:
        line = stream.readline()
    else:
        data = raw.readline()
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as e:
            return data.decode("utf-8", "replace"), (f"the line is not valid UTF-8 (byte {data[e.start]:#04x} at "
                                                     f"offset {e.start}); nothing was sent")
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates (a stream decoded with surrogateescape)
        return line, f"the line is not valid UTF-8 (character {ord(line[e.start]):#06x} at {e.start}); nothing was sent"
    return line, ""


def run_chat(args: argparse.Namespace) -> int:
    """The chat loop. Under torchrun every rank runs it over its shard; rank 0 reads stdin and shares each line."""
    from static_decode.model.parallel import SINGLE

    launch = getattr(args, "launch", None)  # set under torchrun: this rank's shard and device
    tp = launch.tp if launch is not None else SINGLE
    device = launch.device if launch is not None else check_device(args.device)
    check_max_len(args.max_len)
    schema = read_schema(args)  # --json-schema FILE / --json-object, checked before anything loads
    if launch is None or args.threads is not None:  # under torchrun the launcher shares the cores by default
        apply_threads(args)
    path = check_checkpoint(args.model or default_model_path())
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"chat needs a tokenizer.json in {path}")
    template = load_chat_template(path)
    if template is None:
        raise ValueError(f"chat needs a chat template (chat_template.jinja or tokenizer_config.json's chat_template) "
                         f"in {path}")
    model = load_model(path, dtype=args.dtype, device=device, tp=tp, quantize=args.quantize)
    model.kv_dtype = getattr(args, "kv_dtype", None)
    max_len = args.max_len if args.max_len is not None else min(DEFAULT_MAX_LEN, model.config.max_position_embeddings)
    spec = speculation(args, model)
    check_sampler_flags(args, spec is not None, model.config.vocab_size)  # refused now rather than at every turn
    capture = capture_options(args.compile, args.temperature, spec)
    gen = Generator(model, max_len=max_len, chunk_size=args.chunk_size, long_chunk=args.long_chunk, batch=1,
                    compile=args.compile, capture=capture, speculate=spec, grammar_tables=grammar_tables(args))
    grammar = compile_grammar(args, schema, tokenizer, model.config.vocab_size, gen.eos_token_ids)  # every reply's
    session = ChatSession(gen, tokenizer, template, system=args.system, template_kwargs=args.chat_template_kwargs)
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
                "repeat_penalty": args.repeat_penalty, "grammar": grammar, **sampler_options(args)}
    interactive = tp.rank == 0 and sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line, bad = tp.from_rank0(read_line(sys.stdin) if tp.rank == 0 else None)  # every rank takes the same turn
        if not line:  # end of input (Ctrl-D)
            return 0
        if bad:  # refused, the conversation kept
            print(f"static-decode chat: error: {bad}", file=sys.stderr)
            continue
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            session.reset()
            print("[conversation reset]", file=sys.stderr)
            continue
        if not text.strip():
            continue
        cached = len(session.conv.history)
        t0 = time.perf_counter()
        turn = session.turns + 1
        try:
            reply = session.send(text, args.max_new_tokens, **sampling)
            reply = reply if grammar is None else without_eos(reply, gen.eos_token_ids)  # the JSON alone
            shown = write_stream(tokenizer, reply, sys.stdout,
                                 skip_special_tokens=not args.show_special, stops=args.stop)
        except ValueError as e:  # a turn that does not fit: say so, keep the session
            print(f"static-decode chat: error: {e} (/reset starts over)", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        if shown.stopped:
            session.cut(text, shown.text)
            print(f"[turn {turn}: stopped at a --stop string after {len(shown.ids)} tokens; "
                  f"{time.perf_counter() - t0:.2f} s]", file=sys.stderr)
            continue
        s = gen.stats
        how = (f"on {cached} cached" if session.reused else "from scratch"
               + (f" ({session.rescan})" if session.rescan else ""))
        print(f"[turn {turn}: prefilled {s.prompt_tokens} tokens {how}; {s.new_tokens} new; "
              f"{s.ms_per_token:.2f} ms per decoded token; {len(session.conv.tokens)} of {max_len} positions used; "
              f"{time.perf_counter() - t0:.2f} s]", file=sys.stderr)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `chat` with the static-decode CLI (static_decode/commands/cli.py's COMMAND_MODULES)."""
    p = subparsers.add_parser("chat", help="an interactive multi-turn chat (the conversation stays in the cache)")
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint dir, .gguf file or Hub id org/name[@rev], with a tokenizer and a chat template")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens per reply")
    p.add_argument("--max-len", type=int, default=None, help=f"cache positions for the conversation "
                   f"(default: {DEFAULT_MAX_LEN}, or the model's limit if smaller)")
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="prompt slots per prefill step")
    p.add_argument("--long-chunk", type=int, default=None,
                   help="slots of an uncompiled long prefill step, used while a prompt has that many left "
                   "(default: 512 when larger than --chunk-size; 0 = off)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False, help="compile the steps")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    add_quantize_argument(p)
    p.add_argument("--kv-dtype", default=None, choices=("float32", "bfloat16", "float16", "int8"),
                   help="the K/V cache's dtype (default: the model's); a 16-bit cache halves long-context reads, "
                   "int8 (a float32 scale per token and KV head) about halves a 16-bit cache's")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message that opens the conversation")
    add_chat_template_arguments(p, what="every turn")
    add_speculation_arguments(p)
    add_text_arguments(p)
    add_sampler_arguments(p)
    add_structured_arguments(p)
    add_threads_argument(p)
    p.set_defaults(run=run_chat, distributed=True)
