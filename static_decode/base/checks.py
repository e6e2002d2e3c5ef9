"""Argument checks shared by every layer: one wording for a bad int, naming the argument and the value; numpy
scalars are taken wherever a Python number is."""

from __future__ import annotations

import numpy as np


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """`value` as a Python int; TypeError if it is not an int (bools refused), ValueError if below `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return int(value)


def is_number(value: object) -> bool:
    """Whether `value` is a real number: a Python or numpy int or float, not a bool (nor numpy's)."""
    return not isinstance(value, bool | np.bool_) and isinstance(value, int | float | np.integer | np.floating)
