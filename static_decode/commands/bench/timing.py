"""How the bench times a point: one request's prefill and decode wall times (`request`, into a `Timing`), systems
taking turns request by request over the contexts (`time_interleaved`), and the wait for idle CPUs before each timed
request on a shared machine (`IdleGate`). A peer whose worker fails leaves the run; the others go on."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from static_decode.base import ranges
from static_decode.commands.bench.peer import PeerFailed
from static_decode.commands.bench.systems import System


@dataclass
class Timing:
    """Timed requests of one system at one context."""

    steps: int
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the new tokens of the first timed request

    def ms_per_token(self, reduce: Callable[[list[float]], float] = statistics.median) -> float:
        return 1e3 * reduce([d / self.steps for d in self.decode_s])

    def prefill_ms(self, reduce: Callable[[list[float]], float] = statistics.median) -> float:
        return 1e3 * reduce(self.prefill_s)


def request(system: System, prompt: list[int], steps: int, timing: Timing | None, clock=time.perf_counter) -> list[int]:
    """One request of `steps` + 1 new tokens; its prefill and decode wall times go into `timing` (if any)."""
    t0 = clock()
    with ranges.range(ranges.bench_name("prefill")):
        system.start(prompt, steps + 1)
    t1 = clock()
    with ranges.range(ranges.bench_name("decode")):
        tokens = system.finish()
    t2 = clock()
    if len(tokens) != steps + 1:
        raise RuntimeError(f"{system.name} emitted {len(tokens)} tokens, expected {steps + 1}")
    if timing is not None:
        if not timing.tokens:
            timing.tokens = list(tokens)
        timing.prefill_s.append(t1 - t0)
        timing.decode_s.append(t2 - t1)
    return tokens


def time_interleaved(
    systems: Sequence[System], prompts: Mapping[int, list[int]], steps: int, *, repeats: int, warmup: int,
    clock=time.perf_counter, tick: Callable[[int], None] = lambda context: None,
    gate: Callable[[], None] = lambda: None, failed: dict[str, tuple[str, str]] | None = None,
) -> dict[int, dict[str, Timing]]:
    """`warmup` untimed then `repeats` timed requests per system and context (`prompts`: context -> prompt), taking
    turns request by request over the contexts and, within each, the systems: a slower phase of a shared machine then
    falls on every context and system alike, so the ratios between contexts compare as well as those between
    systems (taking the contexts one after another, a phase change between them read as a long-context cost).
    `gate()` runs before each timed request (outside the timing), `tick(context)` after it.

    A peer whose worker fails (PeerFailed: crashed, hung) leaves the run: `failed` gets its name -> (what happened
    and where, the worker's stderr tail), the timings hold none of its requests, and the other systems go on."""
    timings = {L: {s.name: Timing(steps) for s in systems} for L in prompts}
    failed = {} if failed is None else failed
    live = list(systems)

    def attempt(s: System, L: int, phase: str, timing: Timing | None) -> None:
        try:
            request(s, prompts[L], steps, timing, clock)
        except PeerFailed as e:
            failed[s.name] = (f"{e.what} (context {L}, {phase})", e.detail)
            live.remove(s)
            for t in timings.values():
                t.pop(s.name, None)

    with ranges.range(ranges.bench_name("warmup")):
        for _ in range(warmup):
            for L in prompts:
                for s in list(live):
                    attempt(s, L, "warm-up", None)
    for _ in range(repeats):
        for L in prompts:
            for s in list(live):
                gate()
                attempt(s, L, "timed", timings[L][s.name])
                tick(L)
    return timings


class IdleGate:
    """Wait (up to `limit_s`) until the machine's CPUs are >= `threshold` idle over a 0.1 s window, read from
    /proc/stat: on a shared machine a timed request then does not time the neighbours. Counted, never hidden."""

    def __init__(self, limit_s: float, threshold: float = 0.9) -> None:
        self.limit_s, self.threshold = limit_s, threshold
        self.stats = {"limit_s": limit_s, "threshold": threshold, "requests": 0, "gave_up": 0, "waited_s": 0.0}

    @staticmethod
    def idle_fraction(window_s: float = 0.1) -> float:
        def read() -> tuple[int, int]:
            with open("/proc/stat") as f:
                vals = [int(x) for x in f.readline().split()[1:]]
            return vals[3] + vals[4], sum(vals)  # idle + iowait, total

        try:
            i0, t0 = read()
            time.sleep(window_s)
            i1, t1 = read()
        except (OSError, ValueError, IndexError):
            return 1.0  # no /proc/stat: nothing to wait for
        return (i1 - i0) / max(1, t1 - t0)

    def __call__(self) -> None:
        if self.limit_s <= 0:
            return
        self.stats["requests"] += 1
        start = time.monotonic()
        while self.idle_fraction() < self.threshold:
            if time.monotonic() - start > self.limit_s:
                self.stats["gave_up"] += 1
                break
        self.stats["waited_s"] = round(self.stats["waited_s"] + time.monotonic() - start, 2)
