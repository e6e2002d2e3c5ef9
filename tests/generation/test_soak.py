"""Soak: one compiled Generator serving a long random stream of requests, token for token equal to eager.

A tiny random-weight Llama, one `Generator(compile=True)` (the default CPU inductor settings, a fixed batch of 3,
a two-rung ladder) warmed up once, and one eager Generator (no fixed batch: its cache regrows) on the same model.
A seeded stream of requests (ragged batches of 1-3 rows, random prompt lengths and max_new_tokens, greedy and
seeded sampled requests with random temperature/top-k/top-p, EOS on or off, `generate` or `stream` with a random
read_every) runs until at least MIN_REQUESTS requests and MIN_STEPS compiled decode steps are done. Pins:

* every compiled output equals the eager one, token for token;
* after warm-up nothing compiles: no recompile, no new graph, no graph break (`steady_state`);
* resident memory is flat: RSS after the first requests and at the end differ by less than RSS_GROWTH_BOUND.

Run with `-s` to see the measured numbers (steps, requests, seconds, RSS).

Compile cost decides the shape of the run: on this 2-core CPU each sampled (kind, rung) pair takes ~30 s of
inductor lowering when the on-disk inductor cache is cold (the counter-hash noise inlines into a large
expression), a greedy one 2-10 s. So prompts stay within the first rung (prefill compiles once), sampled
requests stay within the first rung too (first + decode at 48), and only greedy requests cross into the second
rung: 6 (kind, rung) pairs, 5 step graphs with the CPU default's symbolic read length (decode_greedy's second
rung reuses its graph; 2 graphs for it on a torch without DynamicInt), and 2 layer-region graphs (T = CHUNK and
T = 1, each compiled once for every kind).
"""

from __future__ import annotations

import gc
import os
import resource
import time

import numpy as np
import pytest
import torch

from capture import CaptureOptions, CaptureReport, steady_state
from capture._dynamo_counters import has_dynamic_int
from static_decode import Generator, Llama, LlamaConfig

pytestmark = pytest.mark.slow

CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
MAX_LEN, CHUNK, LADDER, BATCH = 96, 8, (48, 96), 3
EOS = 95  # an EOS id for both generators; each request draws stop_at_eos
GREEDY_PROMPT_MAX, SAMPLED_PROMPT_MAX = 40, 24  # every prompt fits rung 48: prefill only ever reads <= 48 keys
SAMPLED_LIMIT = LADDER[0]  # prompt + max_new_tokens of a sampled request: its decode steps stay on rung 48
MIN_REQUESTS, MIN_STEPS, MAX_REQUESTS = 100, 5000, 400
RSS_AFTER = 10  # requests before the first RSS reading (the first requests may still grow allocator pools)
# Bound on RSS growth between that reading and the end. The run does > 4,000 decode steps between the two
# readings, so a leak of one small tensor per step (a 96-logit row with its tensor header, ~1 KiB) would add
# several MiB, and one per-request buffer of a few KiB hundreds of KiB more; the bound is set well above the
# noise of glibc malloc arenas and torch's CPU allocator, which move RSS by a few MiB run to run here.
RSS_GROWTH_BOUND = 20 * 2**20
MiB = 2**20




def _rss() -> int:
    """Resident set size of this process in bytes (current, from /proc; peak from getrusage elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux: the peak RSS (KiB on Linux, bytes on macOS) still bounds growth
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _request(rng: np.random.Generator) -> tuple[object, int, dict]:
    """A random request: (prompt, max_new_tokens, keyword arguments), plus how to run it (kw["_via"])."""
    rows = int(rng.integers(1, BATCH + 1))
    sampled = bool(rng.integers(2))
    prompt_max, limit = (SAMPLED_PROMPT_MAX, SAMPLED_LIMIT) if sampled else (GREEDY_PROMPT_MAX, MAX_LEN)
    lens = rng.integers(1, prompt_max + 1, size=rows)
    prompts = [rng.integers(0, CFG.vocab_size, size=int(n)).tolist() for n in lens]
    room = limit - int(lens.max())
    max_new = int(rng.integers(max(1, room // 2), room + 1))  # long requests: the soak is about decode steps
    kw: dict = {"stop_at_eos": bool(rng.random() < 0.5)}
    if sampled:
        kw |= {"temperature": float(rng.uniform(0.3, 1.5)), "seed": int(rng.integers(0, 2**63))}
        if rng.random() < 0.5:
            kw["top_k"] = int(rng.integers(1, CFG.vocab_size + 8))
        if rng.random() < 0.5:
            kw["top_p"] = float(rng.uniform(0.05, 1.0))
    prompt = prompts[0] if rows == 1 and rng.random() < 0.5 else prompts  # a flat prompt or a batch of one
    kw["_via"] = ("stream", int(rng.integers(1, 20))) if rng.random() < 0.25 else ("generate", 0)
    return prompt, max_new, kw


def _run(gen: Generator, prompt: object, max_new: int, kw: dict) -> list:
    kw = dict(kw)
    via, every = kw.pop("_via")
    if via == "generate":
        return gen.generate(prompt, max_new, **kw)
    pieces = list(gen.stream(prompt, max_new, read_every=every, **kw))
    if pieces and isinstance(pieces[0], int):  # a flat prompt streams ids one by one
        return pieces
    rows: list[list[int]] = [[] for _ in pieces[0]]
    for piece in pieces:
        for b, toks in enumerate(piece):
            rows[b].extend(toks)
    return rows


def test_soak_compiled_equals_eager_with_no_recompile_and_flat_memory() -> None:
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        model = Llama(CFG)
        t0 = time.perf_counter()
        gen = Generator(
            model, max_len=MAX_LEN, chunk_size=CHUNK, batch=BATCH, compile=True, eos_token_ids=[EOS],
            capture=CaptureOptions(buckets=LADDER, warm_up="lazy", progress=False),
        )
        gen.warm_up(("prefill", "first", "decode"), buckets=[LADDER[0]], progress=False)
        gen.warm_up(("first_greedy", "decode_greedy"), progress=False)
        warm_s = time.perf_counter() - t0
        records = gen.runner.records
        assert sorted(records) == sorted(
            [("prefill", 48), ("first", 0), ("decode", 48), ("first_greedy", 0), ("decode_greedy", 48),
             ("decode_greedy", 96)]
        )
        assert all(r.graphs in (0, 1) and r.graph_breaks == 0 and not r.fallback for r in records.values())
        assert records[("decode_greedy", 96)].graphs == 1  # warmed up largest rung first: it compiled
        per_kind = CaptureReport(records=list(records.values()), seconds=0.0).graphs_per_kind()
        assert all(g == 1 for g, _ in per_kind.values()) or not has_dynamic_int(), per_kind
        # The CPU default's layer regions: the first kind of each chunk shape also compiles that shape's region
        # (prefill: T = CHUNK, decode: T = 1); every later kind reuses it.
        regions = {p: r.region_graphs for p, r in records.items() if r.region_graphs}
        assert regions == {("prefill", 48): 1, ("decode", 48): 1} or not has_dynamic_int(), regions
        eager = Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[EOS])

        rng = np.random.default_rng(20261130)
        requests = steps = tokens = sampled = 0
        rss_start = rss_end = 0
        t1 = time.perf_counter()
        with steady_state(host_sync=False) as c:
            while requests < MIN_REQUESTS or steps < MIN_STEPS:
                assert requests < MAX_REQUESTS, f"only {steps} decode steps after {requests} requests"
                prompt, max_new, kw = _request(rng)
                got = _run(gen, prompt, max_new, kw)
                steps += gen.stats.decode_steps
                want = _run(eager, prompt, max_new, kw)
                assert got == want, f"request {requests}: prompt={prompt} max_new_tokens={max_new} {kw}"
                flat = got if isinstance(got[0], int) else [t for row in got for t in row]
                assert all(0 <= t < CFG.vocab_size for t in flat)
                tokens += len(flat)
                sampled += "temperature" in kw
                requests += 1
                if requests == RSS_AFTER:
                    gc.collect()
                    rss_start = _rss()
            gc.collect()
            rss_end = _rss()
        loop_s = time.perf_counter() - t1
        assert (c.counts.graphs, c.counts.graph_breaks) == (0, 0)
        assert c.counts.recompiles in (0, -1)  # -1: this torch hides the counter (steady_state checks it anyway)
        assert sorted(gen.runner.records) == sorted(records)  # no (kind, rung) was compiled lazily in the loop
        print(
            f"\nsoak: {requests} requests ({sampled} sampled), {steps} compiled decode steps, {tokens} tokens; "
            f"warm-up {warm_s:.1f} s ({sum(r.graphs for r in records.values())} graphs), "
            f"loop {loop_s:.1f} s (compiled + eager); "
            f"RSS {rss_start / MiB:.1f} MiB after {RSS_AFTER} requests -> {rss_end / MiB:.1f} MiB at the end "
            f"({(rss_end - rss_start) / MiB:+.2f} MiB)"
        )
        assert requests >= MIN_REQUESTS and steps >= MIN_STEPS
        assert rss_end - rss_start < RSS_GROWTH_BOUND, (
            f"RSS grew {(rss_end - rss_start) / MiB:.1f} MiB over {requests - RSS_AFTER} requests"
        )
    finally:
        torch._dynamo.reset()
