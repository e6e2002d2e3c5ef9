"""The sampler options past temperature / top-k / top-p on the command line: --min-p, --presence-penalty,
--frequency-penalty and --logit-bias (generate, demo, chat, serve), parsed into SamplingParams' keywords; their
ranges are SamplingParams' checks."""

from __future__ import annotations

import argparse
import json

from static_decode.generation.request import SamplingParams

# The samplers past temperature / top-k / top-p, as flags: dest -> (flag, what "off" is).
SAMPLER_FLAGS = {"min_p": ("--min-p", 0.0), "presence_penalty": ("--presence-penalty", 0.0),
                 "frequency_penalty": ("--frequency-penalty", 0.0), "logit_bias": ("--logit-bias", ())}


def add_sampler_arguments(p: argparse.ArgumentParser, default: str = "") -> None:
    """--min-p, --presence-penalty, --frequency-penalty and --logit-bias (generate, demo, chat, serve); `default`
    words the help (serve: "default ")."""
    p.add_argument("--min-p", type=float, default=None, metavar="P",
                   help=f"{default}min_p: keep tokens with at least P times the top token's probability after the "
                   "temperature (vLLM's; 0 = off, 0.05-0.1 common)")
    p.add_argument("--presence-penalty", type=float, default=None, metavar="P",
                   help=f"{default}presence_penalty in [-2, 2]: subtract P from the logit of every token already "
                   "emitted (OpenAI's; 0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=None, metavar="P",
                   help=f"{default}frequency_penalty in [-2, 2]: subtract P per time a token was emitted (OpenAI's; "
                   "0 = off)")
    p.add_argument("--logit-bias", type=logit_bias_arg, default=None, metavar="ID=BIAS,...",
                   help=f"{default}logit_bias: add BIAS (in [-100, 100]; -100 all but bans) to token ID's logit, up to "
                   "64 ids, as ID=BIAS,ID=BIAS or a JSON object {\"ID\": BIAS}")


def logit_bias_arg(text: str) -> tuple[tuple[int, float], ...]:
    """--logit-bias: "15=-100,7=2.5" or a JSON object '{"15": -100}' as (id, bias) pairs (ranges checked by
    SamplingParams)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON object: {e}") from None
        if not isinstance(items, dict):
            raise argparse.ArgumentTypeError(f"expected a JSON object of token id -> bias, got {text!r}")
        pairs = list(items.items())
    else:
        pairs = [item.partition("=")[::2] for item in text.replace(" ", "").split(",") if item]
        pairs = [(key, _float(value)) for key, value in pairs]
    out = []
    for key, value in pairs:
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"token id {key!r} is not an int (expected ID=BIAS,...)") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise argparse.ArgumentTypeError(f"bias {value!r} of token {tid} is not a number")
        out.append((tid, float(value)))
    if not out:
        raise argparse.ArgumentTypeError("expected at least one ID=BIAS entry")
    return tuple(out)


def _float(text: str) -> float | str:
    """The number `text` spells, else `text` itself (refused, named, by the caller)."""
    try:
        return float(text)
    except ValueError:
        return text


def sampler_options(args: argparse.Namespace) -> dict[str, object]:
    """The SAMPLER_FLAGS the command line gave, as SamplingParams keywords (None: left out)."""
    return {name: getattr(args, name, None) for name in SAMPLER_FLAGS}


def check_sampler_flags(args: argparse.Namespace, speculating: bool, vocab_size: int | None = None) -> None:
    """SAMPLER_FLAGS checked once at startup, not at every request: a value SamplingParams refuses (or a
    --logit-bias id past `vocab_size`, when given) is a ValueError naming the flag, and with `speculating` so is any
    of them (or --repeat-penalty) set to something but off (the generator refuses them with speculation)."""
    checked = {}
    for name, (flag, _) in SAMPLER_FLAGS.items():
        value = getattr(args, name, None)
        try:
            checked[name] = getattr(SamplingParams(**{name: value}), name)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{flag} {_shown(name, value)}: {e}") from None
    for tid, _ in getattr(args, "logit_bias", None) or ():
        if vocab_size is not None and tid >= vocab_size:
            raise ValueError(f"--logit-bias: token id {tid} is past the vocabulary (ids 0..{vocab_size - 1})")
    if not speculating:
        return
    checked["repeat_penalty"] = getattr(args, "repeat_penalty", None)
    for name, (flag, off) in {"repeat_penalty": ("--repeat-penalty", 1.0), **SAMPLER_FLAGS}.items():
        if checked[name] not in (None, off):
            raise ValueError(f"{flag} {_shown(name, getattr(args, name))} is not supported with --speculate")


def _shown(name: str, value: object) -> str:
    """A flag's value as it was typed (the logit bias as ID=BIAS,...)."""
    if name == "logit_bias" and value is not None:
        return ",".join(f"{t}={b:g}" for t, b in value)
    return str(value)
