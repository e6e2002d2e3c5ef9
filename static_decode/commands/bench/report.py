"""`static-decode bench`'s report: terminal tables, plot, JSON and the checks, from the run's JSON document.

The JSON document (`--json PATH`) has machine, model, bench, systems, rows, bandwidth, bound (each row's bytes floor
over its ms/token: near 1 memory-bound), relative, attention, checks and notes; every field:
docs/internals.md#bench-report.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import rich.table

from capture.buckets import BucketLadder

ONE_CALL = "sdpa_folded"  # attention rows written before "impl" was recorded are this formulation's

CLEARLY_BELOW = 1.2  # full-read / static-decode at max_len/16 counts as "clearly below" from here
ATTENTION_SLACK = 1.25  # attention(bucket) / attention(max_len) within this factor of bucket / max_len
LONG_CONTEXT_SLACK = 1.25  # ms(context) / ms(shortest) within this factor of the bytes ratio
REQUEST_SLACK = 1.1  # a request form (logprobs, a sampler, a grammar) costs at most 10% per token
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int8": 1}


def bytes_per_token(model: dict[str, Any], context: int, weights: int | None = None) -> int:
    """Bytes a decode step must read at `context` live tokens: every weight once plus the live K/V (the floor),
    the K/V in the cache's own dtype (`kv_dtype`; older documents: the model's). `weights`: the system's own
    weight bytes; None: the model's (older documents: its quantized count, else every parameter in its dtype)."""
    size = DTYPE_BYTES[model["dtype"]]
    kv_size = DTYPE_BYTES[model.get("kv_dtype", model["dtype"])]
    kv = 2 * model["layers"] * model["kv_heads"] * model["head_dim"] * kv_size  # K and V of one token, all layers
    if model.get("kv_dtype") == "int8":  # int8 codes and a float32 scale per token and KV head (core/kv_quant.py)
        kv = 2 * model["layers"] * model["kv_heads"] * (model["head_dim"] + 4)
    if weights is None:
        weights = model.get("weight_bytes", model["parameters"] * size)
    return weights + context * kv


def weight_bytes(doc: dict[str, Any]) -> dict[str, int]:
    """system name -> the weight bytes it counted for itself (systems that did not: absent)."""
    return {e["system"]: e["weight_bytes"] for e in doc.get("systems", []) if "weight_bytes" in e}


def bound(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each decode row's rate against the bytes floor: bytes_per_token / ms_per_token in GB/s, and that over the
    mean of the read bandwidth measured before and after the sweep (absent without model facts or a probe)."""
    model, bw = doc.get("model", {}), doc.get("bandwidth")
    if not bw or not {"parameters", "dtype", "layers", "kv_heads", "head_dim"} <= set(model):
        return []
    read = (bw["read_gbps_before"] + bw["read_gbps_after"]) / 2
    own = weight_bytes(doc)
    out = []
    for r in doc["rows"]:
        nbytes = bytes_per_token(model, r["context"], own.get(r["system"]))
        gbps = nbytes / (r["ms_per_token"] * 1e-3) / 1e9
        out.append({"system": r["system"], "context": r["context"], "bytes_per_token": nbytes,
                    "gbps": round(gbps, 2), "read_fraction": round(gbps / read, 2)})
    return out


def relative(doc: dict[str, Any]) -> dict[str, Any]:
    """Every row's median ms/token and prefill over those of the first system (the first in the rows) at the
    same context; {} without rows."""
    if not doc["rows"]:
        return {}
    first = doc["rows"][0]["system"]
    base = {r["context"]: r for r in doc["rows"] if r["system"] == first}
    rows = [{"system": r["system"], "context": r["context"],
             **{k: round(r[k] / base[r["context"]][k], 3) for k in ("ms_per_token", "prefill_ms")}}
            for r in doc["rows"] if r["context"] in base]
    return {"to": first, "rows": rows}


def _ms(doc: dict[str, Any], system: str, context: int) -> float | None:
    return next((r["ms_per_token"] for r in doc["rows"] if (r["system"], r["context"]) == (system, context)), None)


def checks(doc: dict[str, Any]) -> dict[str, Any]:
    """The bench's checks as measured ratios (a check whose systems did not run is absent)."""
    out: dict[str, Any] = {}
    contexts, max_len = doc["bench"]["contexts"], doc["bench"]["max_len"]
    pairs = [(c, _ms(doc, "static-decode", c), _ms(doc, "transformers", c)) for c in contexts]
    speedups = [{"context": c, "ratio": round(t / s, 2)} for c, s, t in pairs if s and t]
    if speedups:
        out["transformers_over_static_decode"] = {"by_context": speedups}  # a ratio to read, not a check
    short = max_len // 16
    s, f = _ms(doc, "static-decode", short), _ms(doc, "full-read", short)
    if s and f:
        out["full_read_over_static_decode_at_max_len_16"] = {
            "context": short, "ratio": round(f / s, 2), "expect": f"clearly > 1 (counted from {CLEARLY_BELOW})",
            "met": f / s >= CLEARLY_BELOW,
        }
    # The one-call formulation: what "auto" runs at these rows' head shape (8 KV heads) on 1, 2, 4 or 8 threads.
    att = {r["length"]: r["ms"] for r in doc.get("attention", []) if r.get("impl", ONE_CALL) == ONE_CALL}
    checks = []
    for m in sorted({max_len, max(att, default=0)}):
        live = max(1, m // 16)
        bucket = BucketLadder.default(m).bucket_for(live) if m else 0
        if bucket < m and bucket in att and m in att:
            ideal, got = bucket / m, att[bucket] / att[m]
            over = round(got / ideal, 2)  # judged as shown: a ratio printed at the slack meets it
            checks.append({"max_len": m, "live": live, "bucket": bucket, "ideal_ratio": round(ideal, 4),
                           "measured_ratio": round(got, 4), "over_ideal": over, "met": over <= ATTENTION_SLACK})
    if checks:
        out["attention_bucket_over_max_len"] = {"expect": f"within {ATTENTION_SLACK}x of bucket/max_len",
                                                "checks": checks, "met": all(c["met"] for c in checks)}
    forms = []  # each request form's ms/token over plain greedy's, same weights and context
    for e in doc.get("systems", []):
        if "request" in e:
            plain = e["system"].removesuffix(f" {e['request']}")
            for c in contexts:
                ms, ref = _ms(doc, e["system"], c), _ms(doc, plain, c)
                if ms and ref:
                    ratio = round(ms / ref, 3)  # judged as shown
                    forms.append({"system": e["system"], "over": plain, "context": c, "ratio": ratio,
                                  "met": ratio <= REQUEST_SLACK})
    if forms:
        out["request_forms_over_greedy"] = {"expect": f"ms/token within {REQUEST_SLACK}x of plain greedy's",
                                            "by_context": forms, "met": all(f["met"] for f in forms)}
    model = doc.get("model", {})
    first = min(contexts)
    base = _ms(doc, "static-decode", first)
    facts = {"parameters", "dtype", "layers", "kv_heads", "head_dim"} <= set(model)
    if base and facts and model["dtype"] in DTYPE_BYTES:
        growth = []
        for c in sorted(contexts)[1:]:
            ms = _ms(doc, "static-decode", c)
            if ms:
                own = weight_bytes(doc).get("static-decode")
                ideal = bytes_per_token(model, c, own) / bytes_per_token(model, first, own)
                other = _ms(doc, "llama.cpp", c)
                over = round(ms / base / ideal, 2)  # judged as shown
                growth.append({
                    "context": c, "ideal_ratio": round(ideal, 3), "measured_ratio": round(ms / base, 3),
                    "over_ideal": over, "met": over <= LONG_CONTEXT_SLACK,
                    **({"llama_cpp_over_static_decode": round(other / ms, 2)} if other else {}),
                })
        if growth:
            out["long_context_over_bytes"] = {
                "expect": f"ms(context) / ms({first}) within {LONG_CONTEXT_SLACK}x of (weights + live K/V) bytes ratio",
                "by_context": growth, "met": all(g["met"] for g in growth),
            }
    return out


def _by_context(title: str, names: list[str], contexts: list[int], rows: list[dict],
                cell: Callable[[dict], str]) -> rich.table.Table:
    """A table of one cell per context and system from `rows` (dicts with "system" and "context"); blank where a
    system has no row."""
    from rich.table import Table

    t = Table(title=title)
    t.add_column("context", justify="right")
    for n in names:
        t.add_column(n, justify="right")
    for c in contexts:
        row = {x["system"]: x for x in rows if x["context"] == c}
        t.add_row(str(c), *(cell(row[n]) if n in row else "" for n in names))
    return t


def tables(doc: dict[str, Any]) -> list[Any]:
    from rich.table import Table

    m, b = doc["machine"], doc["bench"]
    failed = {s["system"]: s["failed"] for s in doc["systems"] if "failed" in s}
    names = [s["system"] for s in doc["systems"] if "mode" in s and s["system"] not in failed]
    title = (f"decode ms/token (median of {b['repeats']} requests x {b['steps']} steps), max_len {b['max_len']}; "
             f"{m['cpu']} ({m['cores']} cores, {m['threads']} threads), torch {m['torch']}")
    ratios = [(n, "static-decode") for n in ("transformers", "full-read") if n in names and "static-decode" in names]
    out = []
    for key, label in (("ms_per_token", title), ("prefill_ms", "prefill ms (median)")):
        t = Table(title=label)
        t.add_column("context", justify="right")
        for n in (*names, *failed):
            t.add_column(n, justify="right")
        if key == "ms_per_token":
            for a, ref in ratios:
                t.add_column(f"{a} / {ref}", justify="right")
        for c in b["contexts"]:
            row = {r["system"]: r for r in doc["rows"] if r["context"] == c}
            cells = [f"{row[n][key]:.3f}" + ("" if row[n]["tokens_match"] is not False else " ≠") for n in names]
            cells += [what.split(" (")[0] for what in failed.values()]  # "crashed, SIGSEGV"
            if key == "ms_per_token":
                cells += [f"{row[a][key] / row[ref][key]:.2f}x" for a, ref in ratios]
            t.add_row(str(c), *cells)
        out.append(t)
    rel = doc.get("relative") or {}
    if len(names) > 1 and rel.get("rows"):
        out.append(_by_context(f"median over {rel['to']}'s (ms/token | prefill)", names, b["contexts"], rel["rows"],
                               lambda r: f"{r['ms_per_token']:.2f}x | {r['prefill_ms']:.2f}x"))
    s = Table(title="systems")
    for col in ("system", "setup s", "weights MB", "mode"):
        s.add_column(col)
    for e in doc["systems"]:
        mb = f"{e['weight_bytes'] / 1e6:.1f}" if "weight_bytes" in e else ""
        how = f"FAILED: {e['failed']}" if "failed" in e else e.get("mode") or e.get("skipped", "")
        s.add_row(e["system"], f"{e['setup_s']:.1f}", mb, how)
    out.append(s)
    if doc.get("bound"):
        bw = doc["bandwidth"]
        title = (f"bytes floor (own weights + live K/V) per ms/token, GB/s (fraction of the read bandwidth, "
                 f"{bw['read_gbps_before']} / {bw['read_gbps_after']} GB/s before / after)")
        out.append(_by_context(title, names, b["contexts"], doc["bound"],
                               lambda r: f"{r['gbps']:.1f} ({r['read_fraction']:.2f})"))
    if doc.get("attention"):
        a = Table(title="decode attention alone, Llama-3.1-8B heads (Hq 32, Hkv 8, d 128), vs read bandwidth "
                        f"{doc['attention'][0]['read_bandwidth_gbps']} GB/s")
        a.add_column("impl")
        for col in ("length", "ms", "GB/s", "fraction of read bw"):
            a.add_column(col, justify="right")
        for r in doc["attention"]:
            a.add_row(r.get("impl", ONE_CALL), str(r["length"]), f"{r['ms']:.3f}", f"{r['gbps']:.1f}",
                      f"{r['bandwidth_fraction']:.2f}")
        out.append(a)
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    """PNG of ms/token against context, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for e in doc["systems"]:
        rows = sorted((r for r in doc["rows"] if r["system"] == e["system"]), key=lambda r: r["context"])
        if rows:
            ax.plot([r["context"] for r in rows], [r["ms_per_token"] for r in rows], marker="o", label=e["system"])
    values = [r["ms_per_token"] for r in doc["rows"]]
    if values and max(values) > 10 * min(values):
        ax.set_yscale("log")
    m, b = doc["machine"], doc["bench"]
    ax.set(xlabel="live context (tokens)", ylabel="ms per decoded token (median)",
           title=f"decode latency, max_len {b['max_len']}\n{m['cpu']}, {m['threads']} threads, torch {m['torch']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(doc: dict[str, Any], *, json_path: Path | None = None, plot_path: Path | None = None) -> None:
    """Print the tables, checks and notes; write the JSON and the plot when asked."""
    from rich.console import Console

    console = Console(width=max(120, Console().width))
    for t in tables(doc):
        console.print(t)
    for name, t in doc["checks"].items():
        verdict = "ratio" if "met" not in t else "holds" if t["met"] else "FAILS"
        console.print(f"{name}: {verdict} ({json.dumps(t)})")
    for note in doc["notes"]:
        console.print(f"note: {note}")
    load = doc["machine"]
    console.print(f"load average before {load['load_avg_before']}, after {load['load_avg_after']}"
                  + (f"; idle gate {load['idle_gate']}" if "idle_gate" in load else ""))
    if json_path is not None:
        json_path.write_text(json.dumps(doc, indent=1) + "\n")
    if plot_path is not None:
        plot(doc, plot_path)
