"""Cost of an NVTX range with no profiler attached, against a bare no-op context manager.

    python profiles/nvtx_cost.py [--iters 1000000]

Prints ns per enter+exit for: an empty loop body, a bare no-op context manager (the floor of any `with`),
`static_decode.base.ranges.range` (cached object, the way the library uses it), the same built per call, the
nvtx package's own `nvtx.annotate`, and the ranges module reloaded without nvtx (the ImportError fallback).
Under nsys the real domain is live and a range costs more (the tool records it); this script measures the
case every user pays: ranges compiled in, nobody listening.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

import static_decode.base.ranges as ranges


class _Bare:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _ns_per_iter(body, iters: int, repeats: int = 5) -> float:
    """Best of `repeats` runs of `body(iters)`, in ns per iteration."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        body(iters)
        best = min(best, (time.perf_counter_ns() - t0) / iters)
    return best


def measure(iters: int = 1_000_000) -> dict[str, float]:
    """ns per iteration of each variant (best of 5)."""
    bare = _Bare()
    cached = ranges.range(ranges.DECODE_STEP)

    def empty(n):
        for _ in range(n):
            pass

    def with_bare(n):
        for _ in range(n):
            with bare:
                pass

    def with_cached(n):
        for _ in range(n):
            with cached:
                pass

    def with_lookup(n):
        r = ranges.range
        for _ in range(n):
            with r("decode/step"):
                pass

    out = {
        "empty loop": _ns_per_iter(empty, iters),
        "bare no-op context manager": _ns_per_iter(with_bare, iters),
        "ranges.range, cached object": _ns_per_iter(with_cached, iters),
        "ranges.range(name) per call": _ns_per_iter(with_lookup, iters),
    }
    try:
        import nvtx

        def with_annotate(n):
            for _ in range(n):
                with nvtx.annotate("decode/step", domain=ranges.DOMAIN):
                    pass

        out["nvtx.annotate(name) per call"] = _ns_per_iter(with_annotate, iters)
    except ImportError:
        pass
    saved = sys.modules.get("nvtx")
    sys.modules["nvtx"] = None  # the fallback path: `import nvtx` raises ImportError
    try:
        fallback = importlib.reload(ranges)
        null = fallback.range(fallback.DECODE_STEP)

        def with_null(n):
            for _ in range(n):
                with null:
                    pass

        out["ranges.range without nvtx"] = _ns_per_iter(with_null, iters)
    finally:
        if saved is None:
            sys.modules.pop("nvtx", None)
        else:
            sys.modules["nvtx"] = saved
        importlib.reload(ranges)
    return out


def describe() -> dict[str, object]:
    return {
        "nvtx_installed": ranges.AVAILABLE,
        "profiler_attached": ranges.AVAILABLE and ranges._domain() is not None,
        "python": sys.version.split()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=1_000_000)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    rows = measure(args.iters)
    if args.json:
        print(json.dumps({"setup": describe(), "ns_per_range": rows}, indent=2))
        return
    print(describe())
    floor = rows["bare no-op context manager"]
    for name, ns in rows.items():
        print(f"{name:34s} {ns:8.1f} ns   ({ns - floor:+7.1f} ns vs bare no-op)")


if __name__ == "__main__":
    main()
