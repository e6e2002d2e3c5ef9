"""The request forms `static-decode bench --requests` times beside plain greedy decode: token logprobs, each
sampler and structured output, so what a request asks for is priced per token.

Each form is one static-decode system per weight form ("static-decode min-p"), with its own Generator and
graphs. The greedy-preserving forms (logprobs) compare their tokens with plain static-decode's; the others draw or
bend the distribution, so their tokens are compared with nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from static_decode.checkpoints.loading import load_tokenizer
from static_decode.generation.request import SamplingParams
from static_decode.generation.structured import DEFAULT_GRAMMAR_TABLES, Grammar

LOGPROBS = 5  # the alternatives a logprobs request asks for
# A schema whose shortest valid text is longer than any bench request (a title of at least 600 characters first),
# so a constrained request decodes every one of its steps.
SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "minLength": 600}, "year": {"type": "integer"}},
    "required": ["title", "year"],
}


@dataclass(frozen=True)
class RequestForm:
    """One form: the SamplingParams fields a request sets, whether its tokens are greedy's (compared with plain
    static-decode's), and what its Generator needs (`logprobs`: max_logprobs; `grammar`: grammar tables)."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    greedy: bool = True
    grammar: bool = False

    @property
    def sampled(self) -> bool:
        return self.options.get("temperature", 0.0) > 0


HOT = {"temperature": 0.8, "seed": 0}
FORMS = {f.name: f for f in (
    RequestForm("greedy"),
    RequestForm("logprobs", {"logprobs": LOGPROBS}),
    RequestForm("temperature", HOT, greedy=False),
    RequestForm("top-k", HOT | {"top_k": 40}, greedy=False),
    RequestForm("top-p", HOT | {"top_p": 0.9}, greedy=False),
    RequestForm("min-p", HOT | {"min_p": 0.1}, greedy=False),
    RequestForm("repeat-penalty", {"repeat_penalty": 1.1}, greedy=False),
    RequestForm("presence", {"presence_penalty": 0.5}, greedy=False),
    RequestForm("frequency", {"frequency_penalty": 0.5}, greedy=False),
    RequestForm("logit-bias", {"logit_bias": {i: (-1.0) ** i * 5.0 for i in range(1, 17)}}, greedy=False),
    RequestForm("json-schema", greedy=False, grammar=True),
)}


def request_forms(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """The forms of --requests ("greedy,logprobs,min-p" or a sequence), each a name of FORMS, no two alike;
    ("greedy",) for None."""
    if value is None:
        return ("greedy",)
    items = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(t.strip() for t in items if t.strip())
    unknown = [n for n in names if n not in FORMS]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"--requests must be distinct names from {', '.join(FORMS)}, got {','.join(names) or '()'}")
    return names


def sampling(form: RequestForm, path: Path, vocab: int) -> SamplingParams:
    """The SamplingParams of one form's requests (no stop at EOS: every request decodes its steps). The
    json-schema form compiles SCHEMA with the checkpoint's tokenizer; a checkpoint without one is refused."""
    options = dict(form.options)
    if form.grammar:
        tokenizer = load_tokenizer(path)
        if tokenizer is None:
            raise ValueError(f"--requests json-schema needs a tokenizer; {path} has none")
        options["grammar"] = Grammar.json_schema(SCHEMA, tokenizer, vocab_size=vocab)
    return SamplingParams(stop_at_eos=False, **options)


def generator_options(form: RequestForm) -> dict[str, Any]:
    """What the form's Generator needs beyond plain decode: logprob buffers, or the grammar's device tables."""
    options: dict[str, Any] = {"max_logprobs": LOGPROBS} if "logprobs" in form.options else {}
    if form.grammar:
        options["grammar_tables"] = DEFAULT_GRAMMAR_TABLES
    return options


def describe(form: RequestForm) -> str:
    """The form's fields in one line ("temperature=0.8, seed=0, min_p=0.1")."""
    if form.grammar:
        return "response_format json_schema: an object with a title of >= 600 characters and a year"
    parts = []
    for k, v in form.options.items():
        parts.append(f"{k}: {len(v)} entries" if isinstance(v, dict) else f"{k}={v}")
    return ", ".join(parts) or "greedy"


def system_name(base: str, form: str) -> str:
    """"static-decode int8" and "min-p" -> "static-decode int8 min-p"; greedy keeps the base name."""
    return base if form == "greedy" else f"{base} {form}"
