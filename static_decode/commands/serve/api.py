"""The OpenAI API's request bodies, checked: what `static-decode serve` accepts, and its error bodies.

Every check runs before a request is queued, so a refused request changes nothing on the server. A refusal is
an `APIError`: an HTTP status and OpenAI's error body, {"error": {"message", "type", "param", "code"}}.
Extensions: `top_k`, `ignore_eos`, `repeat_penalty`; `min_p` as vLLM and llama.cpp take it. `logit_bias` (string token
ids as OpenAI sends them), `presence_penalty` and `frequency_penalty` are OpenAI's. Fields the API defines and this
server does not use (user, ...) are accepted and ignored, as llama.cpp's server does; those whose meaning it
cannot honour (`n` > 1) are refused. A /v1/completions `prompt` that lists several prompts (strings, or lists of
token ids) is several requests checked together, answered one after another as the choices of one response. A
chat's template inputs (tools, tool_choice, tool calls and results, chat_template_kwargs, reasoning_format) are
checked in static_decode.commands.serve.messages, logprobs, top_logprobs and echo in
static_decode.commands.serve.logprobs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from static_decode.commands.serve import logprobs as scored_fields
from static_decode.commands.serve import messages as chat_fields
from static_decode.commands.serve import structured as formats
from static_decode.generation.request import SamplingParams, check_request
from static_decode.generation.structured import Grammar
from static_decode.text import tool_calls
from static_decode.text.chat_template import ChatTemplate
from static_decode.text.reasoning import START as REASONING_START
from static_decode.text.tool_calls import ToolFormat


class APIError(Exception):
    """A refused request: HTTP `status` and OpenAI's error body."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Sampling:
    """The server's defaults for what a request leaves out (the command line's sampling options)."""

    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    repeat_penalty: float | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None  # (token id, bias) pairs
    max_tokens: int | None = None  # None: up to the cache's end


@dataclass(frozen=True)
class Context:
    """What checking a request needs to know about the served model."""

    model_name: str
    tokenizer: Any  # tokenizers.Tokenizer
    template: ChatTemplate | None
    vocab_size: int
    max_len: int
    draft_slots: int = 0
    defaults: Sampling = field(default_factory=Sampling)
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # --chat-template-kwargs (a request's go over)
    reasoning_format: str = "none"  # --reasoning-format: "deepseek" returns a <think> span as reasoning_content
    grammars: formats.GrammarCache | None = None  # serve --structured: response_format's compiled grammars


@dataclass(frozen=True)
class Completion:
    """A checked request of either endpoint: the prompt's token ids and how to decode."""

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False  # extension (as in vLLM and llama.cpp): decode max_tokens whatever the model emits
    repeat_penalty: float | None = None  # extension (as in llama.cpp): divide seen tokens' positive logits by it
    min_p: float | None = None  # extension (as in vLLM and llama.cpp): keep tokens with >= min_p x the top one's
    presence_penalty: float | None = None  # OpenAI's, over the tokens emitted so far
    frequency_penalty: float | None = None  # OpenAI's, per emission of a token
    logit_bias: tuple[tuple[int, float], ...] | None = None  # OpenAI's, as (token id, bias) pairs
    reasoning: bool = False  # chat: the reply's <think> span goes to reasoning_content (reasoning_format deepseek)
    reasoning_open: bool = False  # the rendered prompt ends with <think>: the reply starts inside its reasoning
    logprobs: int | None = None  # alternatives per token of the answer's logprobs (None: no logprobs)
    echo: bool = False  # completions: the prompt's text (and with logprobs its tokens') before the completion's
    echo_text: str = ""  # that text: the prompt string, or the prompt ids decoded
    grammar: Grammar | None = None  # response_format's constraint, or a forced tool call's (None: free text)
    tool_format: ToolFormat | None = None  # chat with tools: the format the reply's calls are parsed in (None: none)


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# Fields peers' clients send that change the output, which this server does not honour: a request that sets one to
# anything but its neutral value is refused (400 naming it), never answered as if it were not there. field -> the
# values that leave the output as it is.
UNHONOURED: dict[str, tuple[Any, ...]] = {
    "typical_p": (None, 1, 1.0),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True),  # the calls a reply makes are parsed as written, never cut to one
    "documents": (None,), "chat_template": (None,),  # vLLM's template arguments
    "continue_final_message": (None, False), "add_generation_prompt": (None, True),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "grammar": (None, ""),  # llama.cpp's
    "json_schema": (None, {}),  # llama.cpp's
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),  # vLLM's
}


def _unhonoured(body: dict[str, Any]) -> None:
    """400 for the first field in UNHONOURED set to a value other than its neutral ones."""
    for name, neutral in UNHONOURED.items():
        v = body.get(name)
        if not any(type(v) is type(n) and v == n for n in neutral):  # True is not 1, 0.0 is listed apart
            shown = json.dumps(v)[:80] if _jsonable(v) else repr(v)[:80]
            allowed = " or ".join("null" if n is None else json.dumps(n) for n in neutral)
            raise _bad(f"{name} is not supported by this server (got {shown}); leave it out or set it to {allowed}",
                       name)


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return False
    return True


def _encode(ctx: Context, text: str, param: str, **kw: Any) -> list[int]:
    """The tokenizer's ids of `text`, or a 400 naming `param` (a lone surrogate, say, which JSON allows)."""
    try:
        text.encode("utf-8")
        return ctx.tokenizer.encode(text, **kw).ids
    except UnicodeEncodeError as e:
        raise _bad(f"{param} is not valid Unicode text: a lone surrogate {ord(text[e.start]):#06x} at character "
                   f"{e.start}", param) from e
    except Exception as e:  # noqa: BLE001 - whatever the tokenizer refuses is the request's fault
        raise _bad(f"{param} cannot be tokenized: {type(e).__name__}: {e}", param) from e


def _number(body: dict[str, Any], name: str, default: float | None, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
        raise _bad(f"{name} must be a number in [{lo}, {hi}], got {v!r}", name)
    return float(v)


def _int(body: dict[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _bad(f"{name} must be an integer >= {minimum}, got {v!r}", name)
    return v


def _logit_bias(body: dict[str, Any], ctx: Context) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's logit_bias, an object of token id (a string of digits, as JSON keys are) -> bias in [-100, 100], as
    (id, bias) pairs; absent or null: the server's default."""
    v = body.get("logit_bias")
    if v is None:
        return ctx.defaults.logit_bias
    if not isinstance(v, dict):
        raise _bad(f"logit_bias must be an object of token id -> bias, got {json.dumps(v)[:80]}", "logit_bias")
    pairs = []
    for key, bias in v.items():
        if not (key.isascii() and key.isdecimal()):
            raise _bad(f"logit_bias keys must be token ids (strings of digits), got {key!r}", "logit_bias")
        if not 0 <= int(key) < ctx.vocab_size:
            raise _bad(f"logit_bias names token id {key}; token ids are 0..{ctx.vocab_size - 1}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise _bad(f"logit_bias[{key!r}] must be a number in [-100, 100], got {json.dumps(bias)[:80]}",
                       "logit_bias")
        pairs.append((int(key), bias))
    try:
        return SamplingParams(logit_bias=pairs).logit_bias  # ranges, count, repeated ids ("7" and "07")
    except (ValueError, TypeError) as e:
        raise _bad(str(e), "logit_bias") from e


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad(f"stop must be a non-empty string or a list of them, got {v!r}", "stop")
    return tuple(stops)


def _body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _prompt_ids(body: dict[str, Any], ctx: Context, chat: bool,
                tools: list[dict[str, Any]] | None = None) -> tuple[list[int], str]:
    """The prompt's ids and, for a chat, the rendered template's text (with `tools`, checked by the caller)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad(f"messages must be a non-empty list of messages, got {messages!r}", "messages")
        try:  # the chat fields' own checks (static_decode.commands.serve.messages)
            checked = [chat_fields.chat_message(i, m) for i, m in enumerate(messages)]
            kwargs = chat_fields.template_kwargs(body, ctx.template_kwargs)
        except chat_fields.FieldError as e:
            raise _bad(str(e), e.param) from e
        if ctx.template is None:
            raise _bad(f"model {ctx.model_name!r} has no chat template (chat_template.jinja or tokenizer_config.json's "
                       "chat_template); use /v1/completions with a prompt", "messages")
        try:
            text = ctx.template.render(checked, add_generation_prompt=True, tools=tools, kwargs=kwargs)
        except ValueError as e:  # the template refused (raise_exception), or does not parse
            raise _bad(str(e), "messages") from e
        except Exception as e:  # noqa: BLE001 - a template failing on these messages (jinja2's errors, a bad op)
            raise _bad(f"the chat template failed on these messages: {type(e).__name__}: {e}", "messages") from e
        return _encode(ctx, text, "messages", add_special_tokens=False), text  # a template writes its own BOS
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    try:
        chat_fields.refuse_chat_only(body)
    except chat_fields.FieldError as e:
        raise _bad(str(e), e.param) from e
    if isinstance(prompt, str) and prompt:
        return _encode(ctx, prompt, "prompt"), ""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < ctx.vocab_size for t in prompt):
            raise _bad(f"prompt token ids must be in 0..{ctx.vocab_size - 1}, got {prompt!r}", "prompt")
        return list(prompt), ""
    raise _bad(f"prompt must be a non-empty string, a list of token ids, or a list of either (several prompts), "
               f"got {json.dumps(prompt)[:120] if _jsonable(prompt) else repr(prompt)[:120]}", "prompt")


MAX_PROMPTS = 1024  # prompts in one /v1/completions request (each is checked before any runs)


def _prompt_list(body: dict[str, Any]) -> list[Any] | None:
    """A /v1/completions prompt of several prompts (a list of two or more strings or lists), else None."""
    prompt = body.get("prompt")
    if not (isinstance(prompt, list) and len(prompt) > 1 and any(isinstance(p, str | list) for p in prompt)):
        return None
    if len(prompt) > MAX_PROMPTS:
        raise _bad(f"prompt lists {len(prompt)} prompts; a request takes at most {MAX_PROMPTS}", "prompt")
    return prompt


def parse_all(raw: bytes, ctx: Context, *, chat: bool) -> list[Completion]:
    """The checked requests of one HTTP request: one, or one per prompt of a /v1/completions prompt list, in order
    (every prompt checked before any is answered: a bad one refuses the whole request, naming its index)."""
    body = _body(raw)
    prompts = None if chat else _prompt_list(body)
    if prompts is None:
        return [_parse(body, ctx, chat=chat)]
    out = []
    for i, prompt in enumerate(prompts):
        try:
            out.append(_parse({**body, "prompt": prompt}, ctx, chat=False))
        except APIError as e:
            raise APIError(e.status, f"prompt[{i}]: {e.message}", type=e.type, param=e.param, code=e.code,
                           headers=e.headers) from e
    return out


def parse(raw: bytes, ctx: Context, *, chat: bool) -> Completion:
    """The checked request of `/v1/chat/completions` (chat) or `/v1/completions` with one prompt, or an APIError."""
    return _parse(_body(raw), ctx, chat=chat)


def _parse(body: dict[str, Any], ctx: Context, *, chat: bool) -> Completion:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad(f"model must be a string, got {model!r}", "model")
    if model is not None and model != ctx.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {ctx.model_name!r}",
                       param="model", code="model_not_found")
    _unhonoured(body)
    n = _int(body, "n", 1, 1)
    if n != 1:
        raise _bad(f"n must be 1 (this server decodes one stream per request), got {n}", "n")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad(f"stream must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise _bad(f"stream_options must be {{'include_usage': bool}}, got {options!r}", "stream_options")
    d = ctx.defaults
    temperature = _number(body, "temperature", d.temperature, 0.0, 2.0)
    top_p = _number(body, "top_p", d.top_p, 0.0, 1.0)
    top_k = _int(body, "top_k", d.top_k, 0) or None  # 0: off, as in llama.cpp
    seed = _int(body, "seed", d.seed, 0)
    repeat_penalty = _number(body, "repeat_penalty", d.repeat_penalty, 0.0, 10.0)
    min_p = _number(body, "min_p", d.min_p, 0.0, 1.0)
    presence_penalty = _number(body, "presence_penalty", d.presence_penalty, -2.0, 2.0)
    frequency_penalty = _number(body, "frequency_penalty", d.frequency_penalty, -2.0, 2.0)
    logit_bias = _logit_bias(body, ctx)
    samplers = {"min_p": min_p, "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
                "logit_bias": logit_bias}
    for field_name, value in samplers.items():
        if ctx.draft_slots and value:  # the generator refuses these with speculation
            raise _bad(f"{field_name} is not supported by this server, which decodes speculatively (--speculate); "
                       f"leave it out or set it to its neutral value", field_name)
    try:
        logprobs, echo = scored_fields.requested(body, chat)
    except chat_fields.FieldError as e:
        raise _bad(str(e), e.param) from e
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, None, 0 if echo else 1)  # echo with max_tokens 0: the prompt scored alone
    stop = _stop(body)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad(f"ignore_eos must be a boolean, got {ignore_eos!r}", "ignore_eos")
    try:
        reasoning = chat and chat_fields.reasoning_format(body, ctx.reasoning_format) == "deepseek"
    except chat_fields.FieldError as e:
        raise _bad(str(e), e.param) from e
    try:
        tools = chat_fields.chat_tools(body) if chat else None
        choice = chat_fields.tool_choice(body, tools) if chat else None
    except chat_fields.FieldError as e:
        raise _bad(str(e), e.param) from e
    ids, rendered = _prompt_ids(body, ctx, chat, tools)
    room = ctx.max_len - len(ids) - ctx.draft_slots
    if max_tokens is None:
        if room < 1:
            raise _bad(f"the prompt ({len(ids)} tokens) leaves no room for a new token in the server's "
                       f"--max-len {ctx.max_len}", "messages" if chat else "prompt")
        max_tokens = room if d.max_tokens is None else min(d.max_tokens, room)
    elif max(max_tokens, 1) > room:
        drafts = f" + {ctx.draft_slots} draft slots" if ctx.draft_slots else ""
        raise _bad(f"the prompt ({len(ids)} tokens) + {name} ({max_tokens}){drafts} = "
                   f"{len(ids) + max_tokens + ctx.draft_slots} exceeds the server's --max-len {ctx.max_len}", name)
    try:  # the generator's own checks (sampling values it refuses), without touching it
        check_request(ids, max(max_tokens, 1), temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, **samplers,
                      repeat_penalty=repeat_penalty, vocab_size=ctx.vocab_size, max_len=ctx.max_len, max_batch=1,
                      draft_slots=ctx.draft_slots)
    except (ValueError, TypeError) as e:
        raise _bad(str(e)) from e
    try:  # compiled (or found in the cache) once the rest of the request is known good
        grammar = formats.response_format(body, ctx.grammars, ctx.draft_slots > 0)
    except formats.FormatError as e:
        raise _bad(str(e), "response_format") from e
    fmt = None
    if tools and choice != "none" and ctx.template is not None:  # the template that renders tools writes calls
        fmt = tool_calls.detect(ctx.template.tool_source or ctx.template.source)
    if choice not in (None, "none", "auto"):
        fmt = fmt or tool_calls.HERMES
        grammar = _forced_call(ctx, tools or [], choice, fmt, grammar)
    return Completion(chat=chat, prompt_ids=ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                      top_k=top_k, seed=seed, stop=stop, stream=stream,
                      include_usage=bool(options.get("include_usage", False)), ignore_eos=ignore_eos, **samplers,
                      repeat_penalty=repeat_penalty, reasoning=reasoning,
                      reasoning_open=reasoning and rendered.rstrip().endswith(REASONING_START), logprobs=logprobs,
                      echo=echo, echo_text=_echo_text(body, ids, ctx) if echo else "", grammar=grammar,
                      tool_format=fmt)


def _forced_call(ctx: Context, tools: list[dict[str, Any]], choice: str, fmt: ToolFormat,
                 response_format: Grammar | None) -> Grammar:
    """The grammar of a reply that is one call, as `fmt` writes it, of the tool `choice` names (any tool for
    "required"), its arguments held to the tool's parameters schema: structured output on the device."""
    shown = json.dumps(choice)
    if response_format is not None:
        raise _bad(f"tool_choice {shown} forces a call and response_format asks for another output; set one of them",
                   "tool_choice")
    if ctx.draft_slots:
        raise _bad(f"tool_choice {shown} is not supported by this server, which decodes speculatively (--speculate): "
                   "a forced call is constrained output; leave it out or set it to \"auto\"", "tool_choice")
    if ctx.grammars is None:
        raise _bad(f"tool_choice {shown} is not supported by this server: a forced call is constrained output; start "
                   "it with `serve --structured`, or leave it out or set it to \"auto\"", "tool_choice")
    chosen = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice]
    try:
        pattern = tool_calls.call_regex(fmt, chosen, Grammar.args_regex)
        return ctx.grammars.regex(pattern)
    except Exception as e:  # noqa: BLE001 - a parameters schema neither library takes
        raise _bad(f"tool_choice {shown}: the call's grammar cannot be made from the tools' parameters: "
                   f"{type(e).__name__}: {e}", "tools") from e


def _echo_text(body: dict[str, Any], ids: list[int], ctx: Context) -> str:
    """The prompt as echoed: the string given, or the prompt's ids decoded."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else ctx.tokenizer.decode(ids, skip_special_tokens=True)
