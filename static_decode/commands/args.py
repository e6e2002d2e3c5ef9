"""argparse types shared by the commands."""

from __future__ import annotations

import argparse


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated ints ("256,1024,4096"), e.g. --buckets, --contexts, --prompt-ids."""
    try:
        values = tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from e
    if not values:
        raise argparse.ArgumentTypeError("expected at least one int")
    return values


def name_list(text: str) -> tuple[str, ...]:
    """Comma-separated names ("prefill,decode_greedy"), e.g. --kinds, --systems."""
    return tuple(t for t in text.replace(" ", "").split(",") if t)
