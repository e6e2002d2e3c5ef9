"""The `static-decode bench` run: per-token decode latency and prefill time of every system, side by side.

Same model, machine and prompt for every system (static_decode.commands.bench.systems). At each context a request
prefills the prompt's first L tokens (timed as prefill, up to the first token on the host) and decodes `steps`
tokens (timed as decode, every token on the host). Systems take turns request by request, so a neighbour's load
hits all alike; tokens are compared with static-decode's of the same weight form. Under torchrun every rank runs
the tensor-parallel systems in lockstep. Tables and checks: static_decode.commands.bench.report; how a point is
timed: docs/internals.md#bench-run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from capture.buckets import BucketLadder
from static_decode.base import ranges
from static_decode.base.progress import progress_bar
from static_decode.checkpoints.loading import default_model_path, load_tokenizer
from static_decode.commands.args import check_checkpoint, check_device, check_written
from static_decode.commands.bench.config import PROFILE_STEPS, BenchConfig
from static_decode.commands.bench.lineup import load_forms, plan, read_gguf, weights
from static_decode.commands.bench.machine import READ_BYTES, machine, read_bandwidth
from static_decode.commands.bench.peer import PeerFailed, amx_hint
from static_decode.commands.bench.report import bound, checks, relative
from static_decode.commands.bench.requests import FORMS, describe
from static_decode.commands.bench.systems import TP_SYSTEMS, System, build, load_profiles_module
from static_decode.commands.bench.timing import IdleGate, Timing, time_interleaved
from static_decode.core.attention import IMPLS


def make_prompt(path: Path, vocab: int, length: int) -> tuple[list[int], str]:
    """`length` prompt ids and where they come from: this package's own source text through the checkpoint's
    tokenizer (in-distribution for the embedded model, identical on every machine), else seeded random ids."""
    tokenizer = load_tokenizer(path)
    if tokenizer is not None:
        text = "".join(p.read_text() for p in sorted(Path(__file__).parents[2].rglob("*.py")))
        ids = [i for i in tokenizer.encode(text).ids if i < vocab]
        if ids:
            return (ids * (length // len(ids) + 1))[:length], "static_decode/**/*.py source text, tokenized"
    rng = np.random.default_rng(0)
    return rng.integers(0, vocab, size=length).tolist(), "random ids (numpy default_rng(0))"


def run(config: BenchConfig) -> dict[str, Any]:
    """Run the bench; return the JSON document (see static_decode.commands.bench.report for what it holds)."""
    tp = config.tp
    threads = config.threads or max(1, (os.cpu_count() or 1) // tp.world)  # ranks share the host's cores
    torch.set_num_threads(threads)
    path = check_checkpoint(config.model or default_model_path())
    device = check_device(config.device)  # one line for a device this machine lacks, before the model loads
    doc: dict[str, Any] = {"machine": machine(threads, device)}
    # every GGUF's type and tensor bytes (a bad file refused) before minutes of loading and compiling
    facts = {g.path: read_gguf(g.path) for g in config.gguf} if "llama.cpp" in config.systems else {}
    planned = plan(config, facts)
    models = load_forms(path, config, device, tp)  # static-decode's model, once per weight form
    model = models[config.forms[0]]
    if tp.enabled:
        doc["machine"]["tensor_parallel"] = {"world": tp.world, "backend": tp.backend()}
    c = model.config
    prompt, source = make_prompt(path, c.vocab_size, max(config.contexts))
    doc["model"] = {
        "path": "embedded default model" if config.model is None else str(path),
        "parameters": sum(p.numel() for p in model.parameters()), "layers": c.num_layers,
        "hidden": c.hidden_size, "heads": c.num_heads, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "vocab": c.vocab_size, "dtype": str(model.dtype).removeprefix("torch."),
        "kv_dtype": str(model.kv_dtype).removeprefix("torch."),
        # the forms' systems each count their own weight bytes (doc["systems"][i]["weight_bytes"])
        **({"quantize": list(config.quantize)} if config.quantize else {}),
    }
    doc["bench"] = {
        "command": config.command(threads),
        "max_len": config.max_len, "contexts": list(config.contexts), "steps": config.steps,
        "repeats": config.repeats, "warmup": config.warmup, "prompt": source,
        "timing": "per request: ms_per_token = decode wall time / steps (all tokens back on the host), "
        "prefill = wall time to the first token on the host; median (and best) over the timed requests; "
        "systems and contexts interleaved request by request",
    }
    systems: list[System] = []
    failures: dict[str, tuple[str, str, str]] = {}  # peer name -> (what happened and where, stderr tail, build line)
    references: dict[str, str] = {}  # system name -> the system whose tokens its tokens are compared with
    doc["systems"], doc["notes"], rows = [], [], []
    work = len(planned) * (1 + len(config.contexts) * config.repeats) + (config.attention_lengths is not None)
    with progress_bar("bench", work, enabled=config.progress) as advance:
        for p in planned:
            advance(f"setting up {p.name}", 0)
            t0 = time.perf_counter()
            own = models.get(p.form, model)
            if p.skip:
                system, why = None, p.skip
            elif tp.enabled and p.kind not in TP_SYSTEMS:
                system, why = None, "skipped: not tensor-parallel (it runs the whole model in one process)"
            else:
                try:
                    with ranges.range(ranges.bench_name("setup")):
                        system, why = build(p.kind, own, path=path, max_len=config.max_len, settings=config.settings,
                                            transformers_compile=config.transformers_compile,
                                            gguf=p.gguf.path if p.gguf else None, threads=threads,
                                            peer_timeout=config.peer_timeout, request=FORMS[p.request])
                except PeerFailed as e:
                    system, why = None, ""
                    failures[p.name] = (f"{e.what} (setup)", e.detail, e.system_info)
            entry = {"system": p.name, "setup_s": round(time.perf_counter() - t0, 2)}
            if p.request != "greedy":
                entry |= {"request": p.request, "request_fields": describe(FORMS[p.request])}
            if system is not None:
                entry |= {"mode": system.mode, **weights(p, system, own)}
            elif p.name in failures:
                entry |= weights(p, None, own)
            else:
                entry["skipped"] = why
            doc["systems"].append(entry)
            advance(f"{p.name} ready", 1 + (0 if system else len(config.contexts) * config.repeats))
            if system is None:
                if why:
                    doc["notes"].append(f"{p.name}: {why}")
            else:
                system.name = p.name  # "static-decode int8", "llama.cpp Q8_0": the timings are keyed by it
                systems.append(system)
                references[p.name] = p.reference
        gate = IdleGate(config.wait_idle)
        before = read_bandwidth(device)
        failed: dict[str, tuple[str, str]] = {}
        try:
            by_context = time_interleaved(
                systems, {L: prompt[:L] for L in config.contexts}, config.steps, repeats=config.repeats,
                warmup=config.warmup, tick=lambda L: advance(f"context {L}", 1), gate=gate, failed=failed,
            )
        finally:
            for s in systems:
                getattr(s, "close", lambda: None)()  # peers' worker processes
        for s in systems:
            if s.name in failed:
                failures[s.name] = (*failed[s.name], getattr(s, "system_info", ""))
        systems = [s for s in systems if s.name not in failed]
        _record_failures(doc, failures)
        for L, timings in by_context.items():
            for s in systems:
                ref = references[s.name]
                row = _row(s, timings[s.name], L, config.max_len, timings.get(ref))
                rows.append(row | {"compared_with": ref or None})  # "": a request form that is not greedy
        if config.profile is not None and systems:
            _profile(systems[0], prompt[: config.contexts[0]], config.profile)
            doc["notes"].append(f"torch.profiler trace of {PROFILE_STEPS} {systems[0].name} decode steps at "
                                f"context {config.contexts[0]}: {config.profile}")
        doc["rows"] = rows
        after = read_bandwidth(device)
        doc["bandwidth"] = {"read_gbps_before": round(before, 2), "read_gbps_after": round(after, 2),
                            "probe": f"best of 5 float32 sums over {READ_BYTES >> 20} MiB"}
        doc["attention"] = _attention(config, device, doc["notes"], after)
        advance("done", 1 if config.attention_lengths is not None else 0)
    doc["machine"]["load_avg_after"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    if config.wait_idle > 0:
        doc["machine"]["idle_gate"] = gate.stats
    for r in rows:
        if r["tokens_match"] is False:
            doc["notes"].append(f"{r['system']} at context {r['context']}: greedy tokens differ from "
                                f"{r['compared_with']}'s from new token {r['first_mismatch']} on")
    doc["bound"] = bound(doc)
    doc["relative"] = relative(doc)
    doc["checks"] = checks(doc)
    return doc


def _record_failures(doc: dict[str, Any], failures: dict[str, tuple[str, str, str]]) -> None:
    """Each failed peer's entry in doc["systems"] gets `failed` (what happened, where), its stderr's tail and the
    rebuild hint where its build uses AMX; a note says the same in one line."""
    for entry in doc["systems"]:
        if entry["system"] not in failures:
            continue
        what, detail, info = failures[entry["system"]]
        hint = amx_hint(info)
        entry["failed"] = what
        entry |= {"stderr_tail": detail} if detail else {}
        entry |= {"hint": hint} if hint else {}
        doc["notes"].append(f"{entry['system']}: {what}" + (f"; {hint}" if hint else ""))


def _row(s: System, t: Timing, context: int, max_len: int, reference: Timing | None) -> dict[str, Any]:
    match, first = None, None
    if reference is not None:
        diff = [i for i, (a, b) in enumerate(zip(t.tokens, reference.tokens, strict=True)) if a != b]
        match, first = not diff, (diff[0] if diff else None)
    row = {
        "system": s.name, "context": context, "max_len": max_len,
        "ms_per_token": round(t.ms_per_token(), 4), "prefill_ms": round(t.prefill_ms(), 3),
        "ms_per_token_best": round(t.ms_per_token(min), 4), "prefill_ms_best": round(t.prefill_ms(min), 3),
        "decode_steps": t.steps, "repeats": len(t.decode_s), "tokens_match": match, "first_mismatch": first,
        "ms_per_token_samples": [round(1e3 * d / t.steps, 3) for d in t.decode_s],  # one per timed request
    }
    if hasattr(s, "read_len"):  # the read length of the last decode step (a ladder rung, or the live length)
        row["read_len"] = s.read_len(context + t.steps)
    return row


def _profile(system: System, prompt: list[int], path: Path) -> None:
    """A torch.profiler Chrome trace of PROFILE_STEPS decode steps (prefill outside the trace)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with ranges.range(ranges.bench_name("profile")):
        system.start(prompt, PROFILE_STEPS + 1)
        with profile(activities=activities, record_shapes=True) as prof:
            system.finish()
    prof.export_chrome_trace(str(path))
    check_written("--profile", path)


def _attention(
    config: BenchConfig, device: torch.device, notes: list[str], bandwidth: float
) -> list[dict[str, Any]]:
    """Decode attention alone at Llama-3.1-8B head shape vs `bandwidth`, the read bandwidth the sweep's last probe
    measured (profiles/attention_bench.py)."""
    if config.attention_lengths is None:
        return []
    if config.tp.enabled:
        notes.append("attention: skipped under tensor parallelism (it times one device's attention)")
        return []
    bench = load_profiles_module("attention_bench")
    if bench is None:
        notes.append("attention: skipped (profiles/attention_bench.py is only in a source checkout)")
        return []
    # The lengths the checks compare: the bucket of max_len/16 and max_len, for this sweep's max_len and for
    # the longest attention length (an 8B-sized cache).
    lengths = set(config.attention_lengths)
    for m in (config.max_len, max(config.attention_lengths)):
        lengths |= {m, BucketLadder.default(m).bucket_for(max(1, m // 16))}
    with ranges.range(ranges.bench_name("attention")):
        # Every formulation that runs as a kernel here: the eager ones everywhere, flex compiled on CUDA only.
        eager = tuple(i for i in IMPLS if i != "flex")
        rows = bench.attention_rows(tuple(sorted(lengths)), eager, device=device, bandwidth_gbps=bandwidth)
        if device.type == "cuda":
            rows += bench.attention_rows(tuple(sorted(lengths)), ("flex",), compiled=True, device=device,
                                         bandwidth_gbps=bandwidth)
    for r in rows:
        r["read_bandwidth_gbps"] = round(bandwidth, 2)
    return rows
