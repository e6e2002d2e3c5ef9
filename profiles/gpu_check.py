"""The GPU check: one command that decides the CUDA defaults (Llama-3.1-8B shape, random bf16 weights, batch 1).

Phases (profiles/gpu_check_phases.py), each in a process of its own under its own time budget, in this order:

    env                torch, device, SMs; the device-to-device copy rate (CUDA events over many copies)
    correct_attention  each attention formulation against a float64 reference at 1k / 8k / 32k on a few heads
                       (ragged rows, a verify chunk, padded slots)
    model              the whole model on a fresh compile cache: capture seconds per (kind, rung), graphs, graph
                       pool; decode at 1k / 8k / 32k (CUDA events over 50 graph replays); 32 compiled greedy
                       tokens against eager's
    model_warm         a second process on the same compile cache: capture seconds per kind
    embedded           the embedded default model: 32 compiled greedy tokens against eager's
    quant              int8 / int4 weights (profiles/gpu_check_quant.py): decode at 1k, tokens/s against the bf16
                       row, the fraction of the copy rate, greedy tokens against eager's; both int4 products
    attention          decode attention alone over every layer, per formulation and live length (one CUDA graph)
    variants           whole-step decode per setting in question (formulation, static read length, unfused
                       projections, coordinate-descent tuning) on the shape's layer cut to 4 layers

Every row is appended to $OUT/gpu_check_rows.jsonl the moment it is measured (a phase cut by its budget keeps
what it measured); after each phase $OUT/gpu_check_summary.json and gpu_check.md are rewritten from the rows.
`--dry-run` runs every phase on the CPU with a tiny shape (dynamo's eager backend) and writes the same files
(tests/profiles/test_gpu_check.py). Uses the machine's python and packages as they are; torch 2.11 or newer.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402
from gpu_check_common import (  # noqa: E402,F401 - re-exported for gpu_check_tp.py and the tests
    LLAMA_8B,
    TINY,
    Rows,
    Shape,
    Timer,
    copy_bandwidth,
    error_text,
    kv_bytes,
    parser,
    read_rows,
    shape,
    time_decode,
    weight_bytes_per_token,
)

ROWS, SUMMARY, TABLE = "gpu_check_rows.jsonl", "gpu_check_summary.json", "gpu_check.md"
TOTAL_S = 450  # every phase of a device run, python start-up included (the command's limit is 8 minutes)
DRY_BUDGET_S = 60  # per phase on the dry run
SPEED_MARGIN = 0.02  # a setting replaces the default only where it decodes this much faster


def args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="every phase on the CPU with a tiny shape")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "out"))
    ap.add_argument("--phases", default=None, help="comma-separated phases to run (default: all, in order)")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # run one phase in this process
    ap.add_argument("--budget", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--started", type=float, default=None, help=argparse.SUPPRESS)  # time.time() at the launch
    ap.add_argument("--processes", action=argparse.BooleanOptionalAction, default=None,
                    help="each phase in a process of its own (default on the device; the dry run runs them in one "
                         "process, importing torch once)")
    ap.add_argument("--cache-dir", type=Path, default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = args_parser().parse_args(argv)
    from gpu_check_phases import PHASES

    if args.phase is not None:
        return run_phase(args, PHASES)
    names = list(PHASES) if args.phases is None else [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [n for n in names if n not in PHASES]
    if unknown:
        print(f"gpu_check: unknown phase(s) {unknown}; phases: {list(PHASES)}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / ROWS
    rows_path.unlink(missing_ok=True)
    driver = Rows(rows_path, "driver")
    start = time.perf_counter()
    processes = not args.dry_run if args.processes is None else args.processes
    if args.dry_run:
        os.environ["STATIC_DECODE_CPU_KERNEL"] = "0"  # the GPU script's logic, not the CPU kernel's build
    with tempfile.TemporaryDirectory(prefix="gpu_check_cache_") as cache_dir:  # cold: nothing compiled before
        for name in names:
            left = TOTAL_S - (time.perf_counter() - start)
            budget = DRY_BUDGET_S if args.dry_run else min(PHASES[name][0], left)
            if budget < 15:
                driver.add("phase", name=name, rc=None, seconds=0, skipped="no time left")
                continue
            t0 = time.perf_counter()
            if processes:
                cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", name, "--out", str(args.out),
                       "--budget", str(budget), "--cache-dir", cache_dir, "--started", str(time.time())]
                rc = run_process(cmd + (["--dry-run"] if args.dry_run else []), budget)
            else:
                rc = run_phase(args, PHASES, name=name, budget=budget, cache_dir=Path(cache_dir))
            driver.add("phase", name=name, rc=rc, seconds=round(time.perf_counter() - t0, 1), budget_s=budget,
                       process="own" if processes else "driver")
            write_summary(args.out)
    summary = write_summary(args.out)
    print((args.out / TABLE).read_text())
    phases_ok = all(p["rc"] == 0 for p in summary["phases"].values() if p.get("rc") is not None)
    return 0 if summary["correct"] and phases_ok else 1


def run_process(cmd: list[str], budget: float) -> int:
    """Run a phase's process; past its budget kill it and everything it started (inductor's compile workers)."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 124


def run_phase(args: argparse.Namespace, phases: dict, *, name: str | None = None, budget: float | None = None,
              cache_dir: Path | None = None) -> int:
    """One phase in this process; its deadline counts from `--started` (the launch, imports included)."""
    from gpu_check_ctx import Ctx

    name = name or args.phase
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run on the CPU)", file=sys.stderr)
        return 2
    budget = budget if budget is not None else args.budget if args.budget is not None else phases[name][0]
    started = time.perf_counter() - (time.time() - args.started if args.started else 0.0)
    rows_path = args.out / ROWS
    rows = Rows(rows_path, name)
    cache_dir = cache_dir or args.cache_dir or Path(tempfile.mkdtemp(prefix="gpu_check_cache_"))
    ctx = Ctx(dry=args.dry_run, device=device, rows=rows, deadline=started + budget - 5, cache_dir=cache_dir,
              rows_path=rows_path)
    try:
        phases[name][1](ctx)
    except Exception as e:  # noqa: BLE001 - the phase's failure is a row; the next phase still runs
        import traceback

        traceback.print_exc()
        rows.add("phase_error", error=error_text(e))
        return 1
    return 0


# ---- the summary ------------------------------------------------------------------------------------------------
def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The decision file: every key present whatever ran (None / {} where a phase left nothing)."""
    def of(kind: str, **match: Any) -> list[dict[str, Any]]:
        return [r for r in rows if r.get("kind") == kind and all(r.get(k) == v for k, v in match.items())]

    env = (of("env") or [{}])[-1]
    copy = (of("copy") or [{}])[-1].get("gbps")
    decode = [r for r in of("decode", setting="default") if r.get("phase") == "model" and "ms" in r]
    attention: dict[str, dict[str, float]] = {}
    for r in of("attention"):
        if "fraction" in r:
            name = r["impl"] + ("+compile" if r.get("compiled") else "")
            attention.setdefault(name, {})[str(r["live"])] = r["fraction"]
    capture = {p: of("capture", process=p) for p in ("cold", "warm")}
    graphs: dict[str, list[int]] = {}
    pool: dict[str, float] = {}
    for r in capture["cold"]:
        g = graphs.setdefault(r["step"], [0, 0])
        g[0] += r["graphs"]
        g[1] += 1
        pool[r["step"]] = pool.get(r["step"], 0.0) + (r.get("pool_bytes") or 0) / 2**20
    correct_rows = of("correct")
    phases = {r["name"]: {k: r.get(k) for k in ("rc", "seconds", "budget_s", "skipped")} for r in of("phase")}
    for r in of("phase_error"):
        phases.setdefault(r["phase"], {})["error"] = r["error"]
    wanted_checks = {"attention", "greedy_model", "greedy_embedded"}
    checked = {r.get("check") for r in correct_rows}
    failed = (of("formulations_failed") or [{}])[-1].get("failed", {})
    return {
        "torch": env.get("torch"),
        "device": env.get("device"),
        "copy_gbps": copy,
        "decode_ms": {str(r["live"]): r["ms"] for r in decode},
        "copy_fraction": {str(r["live"]): r["copy_fraction"] for r in decode},
        "attention_fraction": attention,
        "capture_s_cold": _seconds(capture["cold"]),
        "capture_s_warm": _seconds(capture["warm"]),
        "capture_s_per_kind": {p: _per_kind(capture[p]) for p in capture},
        "graphs_per_kind": graphs,  # kind -> [graphs compiled, buckets recorded], cold process
        "graph_pool_mib": {k: round(v, 1) for k, v in pool.items()},
        "correct": bool(correct_rows) and all(r.get("ok") for r in correct_rows) and wanted_checks <= checked,
        "correct_failed": [r for r in correct_rows if not r.get("ok")],
        "formulations_failed": failed,
        "variants_ms": _variants(of("decode")),
        "quant": quant_summary(of("quant"), decode, correct_rows),
        "quant_products": products_summary(of("products")),
        "recommended": {**recommend(of("decode"), attention, failed),
                        "int4_kernel": int4_kernel(of("quant"), of("products"))},
        "phases": phases,
    }


def _seconds(records: list[dict[str, Any]]) -> float | None:
    return round(sum(r["seconds"] for r in records), 1) if records else None


def _per_kind(records: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in records:
        out[r["step"]] = round(out.get(r["step"], 0.0) + r["seconds"], 1)
    return out


def _variants(decode_rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for r in decode_rows:
        if r.get("phase") == "variants" and "ms" in r:
            out.setdefault(r["setting"], {})[str(r["live"])] = r["ms"]
    return out


def quant_summary(rows: list[dict[str, Any]], bf16_rows: list[dict[str, Any]],
                  correct_rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per quantized setting: decode ms and tokens/s at its live length, `vs_bf16` (its tokens/s over the bf16
    model's at that length, the `model` phase's row), the fraction of the copy rate, the bytes a step reads, and
    whether its greedy tokens equal eager's; or why it has no figures (skipped, error)."""
    bf16 = {r["live"]: r["ms"] for r in bf16_rows}
    greedy = {r["check"].removeprefix("greedy_"): r for r in correct_rows if r.get("check", "").startswith("greedy_")}
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if "ms" not in r:
            out[r["setting"]] = {k: r[k] for k in ("skipped", "error") if k in r}
            continue
        base = bf16.get(r["live"])
        g = greedy.get(r["setting"], {})
        out[r["setting"]] = {"live": r["live"], "ms": r["ms"], "tokens_per_s": r["tokens_per_s"],
                             "vs_bf16": None if base is None else round(base / r["ms"], 2),
                             "copy_fraction": r["copy_fraction"], "weight_gb": round(r["weight_bytes"] / 1e9, 2),
                             "tokens_equal": g.get("tokens_equal"), "greedy_ok": g.get("ok")}
    return out


def products_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per form (bf16, int8, int4 per product): the step's products alone, ms, GB/s, the fraction of the copy rate
    and `vs_bf16` (the bf16 products' time over the form's); or why it has no figures."""
    timed = {r["form"]: r for r in rows if "ms" in r}
    base = next((r["ms"] for f, r in timed.items() if not f.startswith("int")), None)
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if "ms" not in r:
            out[r["form"]] = {k: r[k] for k in ("skipped", "error") if k in r}
            continue
        out[r["form"]] = {"ms": r["ms"], "gbps": r["gbps"], "copy_fraction": r["copy_fraction"],
                          "vs_bf16": None if base is None else round(base / r["ms"], 2)}
    return out


def int4_kernel(step_rows: list[dict[str, Any]], product_rows: list[dict[str, Any]]) -> str | None:
    """The int4 product the rows argue for: tinygemm where it ran SPEED_MARGIN faster than "reduce" (the
    default, static_decode.model.quant_cuda.DEFAULT_INT4_KERNEL), else "reduce"; judged on whole decode steps where
    both were timed there, else on the products alone; None where neither has both."""
    steps = {r.get("kernel"): r["ms"] for r in step_rows if "ms" in r and r.get("kernel")}
    alone = {r["form"].rpartition("-")[2]: r["ms"] for r in product_rows if "ms" in r and r["form"].startswith("int4")}
    for ms in (steps, alone):
        if {"reduce", "tinygemm"} <= set(ms):
            return "tinygemm" if ms["tinygemm"] < ms["reduce"] * (1 - SPEED_MARGIN) else "reduce"
    return None


def recommend(decode_rows: list[dict[str, Any]], attention: dict[str, dict[str, float]],
              failed: dict[str, str]) -> dict[str, Any]:
    """The settings the rows argue for: a variant replaces the default where its median decode time over the live
    lengths is SPEED_MARGIN faster; the attention formulation with the best whole-step time among those that
    compiled (else the best attention-alone fraction)."""
    ms = _variants(decode_rows)

    def median(name: str) -> float | None:
        return statistics.median(ms[name].values()) if ms.get(name) else None

    base = median("default")

    def faster(name: str) -> bool | None:
        other = median(name)
        return None if base is None or other is None else other < base * (1 - SPEED_MARGIN)

    formulations = {"flex": median("default"), "split_key": median("split_key"), "sdpa_folded": median("sdpa_folded")}
    timed = {k: v for k, v in formulations.items() if v is not None and k not in failed}
    if timed:
        best_attention = min(timed, key=timed.get)
    elif attention:
        best_attention = max(attention, key=lambda k: statistics.median(attention[k].values()))
    else:
        best_attention = None
    static, unfused, coord = faster("static_read_len"), faster("unfused_projections"), faster("coordinate_descent")
    return {
        "attention": best_attention,
        "symbolic_read_len": None if static is None else not static,
        "fused_projections": None if unfused is None else not unfused,
        "coordinate_descent_tuning": coord,
        "basis": "median decode ms over the live lengths per variant; a change needs "
                 f"{SPEED_MARGIN:.0%} over the default",
    }


def write_summary(out: Path) -> dict[str, Any]:
    import json

    summary = summarize(read_rows(out / ROWS))
    (out / SUMMARY).write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (out / TABLE).write_text(table(summary))
    return summary


def table(s: dict[str, Any]) -> str:
    lines = [f"# gpu_check: torch {s['torch']} on {s['device']}", "",
             f"copy {s['copy_gbps']} GB/s; correct: {s['correct']}; capture cold {s['capture_s_cold']} s, warm "
             f"{s['capture_s_warm']} s; graphs per kind {s['graphs_per_kind']}; graph pool MiB {s['graph_pool_mib']}",
             "", "| live | decode ms | of copy |", "| ---: | ---: | ---: |"]
    lines += [f"| {n} | {ms} | {s['copy_fraction'].get(n)} |" for n, ms in s["decode_ms"].items()]
    lines += ["", "| attention (alone) | " + " | ".join(f"{n}" for n in _lengths(s["attention_fraction"])) + " |"]
    for impl, by_len in s["attention_fraction"].items():
        cells = (str(by_len.get(n, "")) for n in _lengths(s["attention_fraction"]))
        lines.append(f"| {impl} | " + " | ".join(cells) + " |")
    lines += ["", "| variant (decode ms) | " + " | ".join(_lengths(s["variants_ms"])) + " |"]
    for name, by_len in s["variants_ms"].items():
        lines.append(f"| {name} | " + " | ".join(str(by_len.get(n, "")) for n in _lengths(s["variants_ms"])) + " |")
    lines += ["", "| products alone | ms | GB/s | of copy | x bf16 |", "| --- | ---: | ---: | ---: | ---: |"]
    for form, p in s["quant_products"].items():
        cells = [p.get(k, "") for k in ("ms", "gbps", "copy_fraction", "vs_bf16")] if "ms" in p else [
            p.get("skipped") or p.get("error"), "", "", ""]
        lines.append(f"| {form} | " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "| weights | live | decode ms | tokens/s | x bf16 | of copy | GB read | tokens equal |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, q in s["quant"].items():
        if "ms" not in q:
            lines.append(f"| {name} | {q.get('skipped') or q.get('error')} | | | | | | |")
            continue
        lines.append(f"| {name} | {q['live']} | {q['ms']} | {q['tokens_per_s']} | {q['vs_bf16']} | "
                     f"{q['copy_fraction']} | {q['weight_gb']} | {q['tokens_equal']} |")
    lines += ["", f"recommended: {s['recommended']}", f"phases: {s['phases']}"]
    if s["correct_failed"]:
        lines += ["", f"failed checks: {s['correct_failed']}"]
    return "\n".join(lines) + "\n"


def _lengths(by_name: dict[str, dict[str, Any]]) -> list[str]:
    return sorted({n for v in by_name.values() for n in v}, key=int)


if __name__ == "__main__":
    sys.exit(main())
