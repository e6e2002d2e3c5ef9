"""NVTX ranges around capture work, so a profile shows which (kind, bucket) each compile/capture was.

Uses the project's range helper (`static_decode.ranges`: one range vocabulary and NVTX domain for the whole
library, itself a no-op without the `nvtx` package) when it is importable, else nothing: ranges are a
profiling aid and never a reason to fail.
"""

from __future__ import annotations

import contextlib
from typing import Any

try:
    from static_decode import ranges as _ranges
except ImportError:  # capture used on its own
    _ranges = None


def capture_range(kind: str, bucket: int) -> contextlib.AbstractContextManager[Any]:
    """The range "capture/<kind>/<bucket>" on the NVTX timeline (host side, around warm-up calls)."""
    if _ranges is None:
        return contextlib.nullcontext()
    return _ranges.range(_ranges.capture_name(kind, bucket))
