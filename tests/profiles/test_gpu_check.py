"""profiles/gpu_check.py's logic runs on the CPU (--dry-run: every phase, a tiny shape), so the one device call
a session may get cannot fail on a plain bug.

Pins: the dry run writes the rows file, the summary (every key the device run must give, `correct` true only when
every correctness row passed and every check ran) and the table; a phase runs in its own process on the device's
path; rows cut short by a kill are skipped; the summary's decisions from synthetic rows (the fastest formulation
that compiled, a setting replacing the default only past the margin); the bytes a step reads.

profiles/gpu_check_tp.py (the multi-GPU check) runs under torchrun on 2 gloo CPU ranks: every (live length,
eager/compiled) case is written with its all-reduce time and share, and each rank's cache holds half the KV
heads (half the world-1 bytes).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from static_decode import Llama
from static_decode.model.parallel import TensorParallel

SCRIPT = Path(__file__).resolve().parents[2] / "profiles" / "gpu_check.py"
SCRIPT_TP = SCRIPT.with_name("gpu_check_tp.py")


def _load(monkeypatch, script: Path = SCRIPT):
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, script.stem, module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


REQUIRED = ("torch", "device", "copy_gbps", "decode_ms", "copy_fraction", "attention_fraction", "capture_s_cold",
            "capture_s_warm", "graphs_per_kind", "correct", "recommended")


def _dry_run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def test_dry_run_writes_every_file_and_key(tmp_path, monkeypatch) -> None:
    """`profiles/gpu_check.py --dry-run`: every phase on the CPU (tiny shape, dynamo's eager backend), the rows file,
    and the summary with every key the device run must produce, `correct` true."""
    gc = _load(monkeypatch)
    from gpu_check_phases import PHASES, VARIANTS

    run = _dry_run(tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == {gc.ROWS, gc.SUMMARY, gc.TABLE}
    s = json.loads((tmp_path / gc.SUMMARY).read_text())
    assert set(REQUIRED) <= set(s)
    sh = gc.shape(tiny=True)
    lengths = {str(n) for n in sh.lengths}
    assert s["torch"] == torch.__version__ and s["device"] == "cpu" and s["copy_gbps"] > 0
    assert set(s["decode_ms"]) == set(s["copy_fraction"]) == lengths
    assert all(v > 0 for v in s["decode_ms"].values())
    assert set(s["attention_fraction"]) == {"flex", "split_key", "sdpa_folded"}
    assert all(set(by_len) == lengths for by_len in s["attention_fraction"].values())
    assert s["capture_s_cold"] > 0 and s["capture_s_warm"] > 0
    # One compile per kind with the symbolic read length: 1 graph per kind whatever the rungs recorded.
    assert {k: g for k, (g, _) in s["graphs_per_kind"].items()} == {"decode_greedy": 1, "prefill": 1,
                                                                     "first_greedy": 1}
    assert s["correct"] is True and s["correct_failed"] == []
    assert set(s["recommended"]) >= {"attention", "symbolic_read_len", "fused_projections",
                                     "coordinate_descent_tuning"}
    assert list(s["phases"]) == list(PHASES) and all(p["rc"] == 0 for p in s["phases"].values())
    rows = gc.read_rows(tmp_path / gc.ROWS)
    assert all({"phase", "kind", "t_s"} <= set(r) for r in rows)
    checks = {(r["check"], r.get("impl"), r.get("live"), r.get("slots")) for r in rows if r["kind"] == "correct"}
    assert {("attention", i, n, t) for i in ("flex", "split_key", "sdpa_folded") for n in sh.lengths
            for t in (1, 4)} <= checks
    assert {("greedy_model", None, None, None), ("greedy_embedded", None, None, None)} <= checks
    variants = {r["setting"] for r in rows if r["kind"] == "decode" and r["phase"] == "variants"}
    assert variants == {v.name for v in VARIANTS}  # measured, or a row saying why not
    capture = [r for r in rows if r["kind"] == "capture" and r.get("process") in ("cold", "warm")]
    assert {(r["process"], r["step"]) for r in capture} == {(p, k) for p in ("cold", "warm")
                                                            for k in ("decode_greedy", "prefill", "first_greedy")}
    assert "| live | decode ms | of copy |" in (tmp_path / gc.TABLE).read_text()
    # Quantized weights: the products alone per form; every whole-step setting timed at the first live length
    # beside the bf16 row, its greedy tokens eager's; each product within tolerance of float64 (one row compiled,
    # several eager).
    from gpu_check_quant import MATMUL_WEIGHTS, settings

    names = {q.name for q in settings("reduce", dry=True)}
    assert names == {"int8", "gguf-q8_0", "int4-g32-reduce", "int4-g32-tinygemm"}
    assert names == {q.name for q in settings("tinygemm", dry=True)}
    assert {q.name for q in settings("reduce")} == names - {"gguf-q8_0"} | {"gguf-q4_k"}  # on the device
    assert set(s["quant_products"]) == {"float32", *names}
    assert all(p["ms"] > 0 and p["vs_bf16"] > 0 for p in s["quant_products"].values())
    assert s["quant_products"]["float32"]["vs_bf16"] == 1.0
    assert set(s["quant"]) == names
    live = str(sh.lengths[0])
    for q in s["quant"].values():
        assert q["live"] == sh.lengths[0] and q["ms"] > 0 and q["tokens_equal"] is True and q["greedy_ok"] is True
        assert abs(q["vs_bf16"] - s["decode_ms"][live] / q["ms"]) <= 0.006  # rounded to 2 decimals
    assert s["quant"]["int4-g32-reduce"]["weight_gb"] == s["quant"]["int4-g32-tinygemm"]["weight_gb"]
    matmul = {(r["setting"], r["weight"], r["rows"]) for r in rows if r.get("check") == "quant_matmul"}
    assert matmul == {(q, w, m) for q in names for w in MATMUL_WEIGHTS for m in (1, 4)}
    assert s["recommended"]["int4_kernel"] in ("reduce", "tinygemm")
    assert "| weights | live | decode ms | tokens/s | x bf16 |" in (tmp_path / gc.TABLE).read_text()


def test_quant_summary_from_rows(monkeypatch) -> None:
    """Tokens/s against the bf16 row at the same live length; the faster int4 product past the margin; a setting
    that never ran says why."""
    gc = _load(monkeypatch)

    def q(setting: str, kernel: str | None, ms: float) -> dict:
        return {"phase": "quant", "kind": "quant", "setting": setting, "scheme": "int4-g32" if kernel else "int8",
                "kernel": kernel, "live": 1024, "ms": ms, "tokens_per_s": round(1e3 / ms, 1), "copy_fraction": 0.5,
                "weight_bytes": 4.5e9}

    bf16 = [{"phase": "model", "kind": "decode", "setting": "default", "live": 1024, "ms": 6.0}]
    greedy = [{"phase": "quant", "kind": "correct", "check": "greedy_int8", "tokens_equal": True, "ok": True}]
    rows = [q("int8", None, 4.0), q("int4-g32-reduce", "reduce", 3.0), q("int4-g32-tinygemm", "tinygemm", 2.0)]
    out = gc.quant_summary(rows, bf16, greedy)
    assert [out[k]["vs_bf16"] for k in ("int8", "int4-g32-reduce", "int4-g32-tinygemm")] == [1.5, 2.0, 3.0]
    assert out["int8"]["tokens_equal"] is True and out["int4-g32-reduce"]["tokens_equal"] is None  # no greedy row
    skipped = {"phase": "quant", "kind": "quant", "setting": "int4-g32-tinygemm", "skipped": "no time left"}
    assert gc.quant_summary([*rows[:2], skipped], [], [])["int4-g32-tinygemm"] == {"skipped": "no time left"}
    assert gc.quant_summary(rows, [], [])["int8"]["vs_bf16"] is None  # no bf16 row to compare with

    def p(form: str, ms: float) -> dict:
        return {"phase": "quant", "kind": "products", "form": form, "ms": ms, "gbps": 1.0, "copy_fraction": 0.5}

    products = [p("bf16", 4.0), p("int8", 2.0), p("int4-g32-reduce", 1.0), p("int4-g32-tinygemm", 1.6)]
    assert {f: v["vs_bf16"] for f, v in gc.products_summary(products).items()} == {
        "bf16": 1.0, "int8": 2.0, "int4-g32-reduce": 4.0, "int4-g32-tinygemm": 2.5}
    # The int4 product: whole steps decide where both ran there, else the products alone; 2% or it stays "reduce".
    assert gc.int4_kernel(rows, products) == "tinygemm"
    assert gc.int4_kernel(rows[:2], products) == "reduce"
    assert gc.int4_kernel([rows[0], rows[1], q("int4-g32-tinygemm", "tinygemm", 2.99)], []) == "reduce"
    assert gc.int4_kernel(rows[:2], products[:3]) is None  # one kernel timed: nothing to decide


def test_a_phase_in_its_own_process(tmp_path, monkeypatch) -> None:
    """The device's way: each phase a process of its own, its rows in the same file."""
    gc = _load(monkeypatch)
    run = _dry_run(tmp_path, "--processes", "--phases", "env")
    rows = gc.read_rows(tmp_path / gc.ROWS)
    assert [r["kind"] for r in rows] == ["env", "copy", "phase"], run.stdout[-2000:] + run.stderr[-2000:]
    assert rows[-1]["process"] == "own" and rows[-1]["rc"] == 0
    assert run.returncode == 1  # no correctness row: the summary cannot say correct
    assert json.loads((tmp_path / gc.SUMMARY).read_text())["correct"] is False


def test_rows_survive_a_kill(tmp_path, monkeypatch) -> None:
    gc = _load(monkeypatch)
    rows = gc.Rows(tmp_path / "r.jsonl", "p")
    rows.add("decode", live=1, ms=2.0)
    with (tmp_path / "r.jsonl").open("a") as f:
        f.write('{"phase": "p", "kind": "dec')  # a line cut short by the phase's timeout
    got = gc.read_rows(tmp_path / "r.jsonl")
    assert len(got) == 1 and got[0]["kind"] == "decode" and got[0]["ms"] == 2.0


def _decode(setting: str, ms: dict[int, float]) -> list[dict]:
    return [{"phase": "variants", "kind": "decode", "setting": setting, "live": n, "ms": v} for n, v in ms.items()]


def test_summary_decides_from_the_rows(monkeypatch) -> None:
    gc = _load(monkeypatch)
    rows = [
        {"phase": "env", "kind": "env", "torch": "2.11.0", "device": "NVIDIA H200"},
        {"phase": "env", "kind": "copy", "gbps": 4000.0},
        {"phase": "model", "kind": "decode", "setting": "default", "live": 1024, "ms": 5.0, "copy_fraction": 0.8},
        {"phase": "model", "kind": "capture", "process": "cold", "step": "decode_greedy", "read_len": 1024,
         "seconds": 50.0, "graphs": 1, "pool_bytes": 2**20},
        {"phase": "model", "kind": "capture", "process": "cold", "step": "decode_greedy", "read_len": 2048,
         "seconds": 2.0, "graphs": 0, "pool_bytes": 2**20},
        {"phase": "model_warm", "kind": "capture", "process": "warm", "step": "decode_greedy", "read_len": 1024,
         "seconds": 9.0, "graphs": 1},
        {"phase": "attention", "kind": "attention", "impl": "flex", "compiled": True, "live": 8192, "fraction": 0.7},
        {"phase": "attention", "kind": "attention", "impl": "split_key", "compiled": True, "live": 8192,
         "error": "x"},
        *[{"phase": "c", "kind": "correct", "check": c, "ok": True}
          for c in ("attention", "greedy_model", "greedy_embedded")],
        *_decode("default", {1024: 10.0, 8192: 12.0}),
        *_decode("split_key", {1024: 9.0, 8192: 11.0}),  # faster: the attention recommended
        *_decode("static_read_len", {1024: 9.9, 8192: 11.9}),  # within the margin: symbolic stays
        *_decode("unfused_projections", {1024: 12.0, 8192: 14.0}),
        *_decode("coordinate_descent", {1024: 8.0, 8192: 9.0}),
        {"phase": "driver", "kind": "phase", "name": "variants", "rc": 124, "seconds": 90.0, "budget_s": 90},
    ]
    s = gc.summarize(rows)
    assert set(REQUIRED) <= set(s)
    assert (s["torch"], s["device"], s["copy_gbps"]) == ("2.11.0", "NVIDIA H200", 4000.0)
    assert s["decode_ms"] == {"1024": 5.0} and s["copy_fraction"] == {"1024": 0.8}
    assert s["attention_fraction"] == {"flex+compile": {"8192": 0.7}}  # a failed row is not a fraction
    assert (s["capture_s_cold"], s["capture_s_warm"]) == (52.0, 9.0)
    assert s["graphs_per_kind"] == {"decode_greedy": [1, 2]} and s["graph_pool_mib"] == {"decode_greedy": 2.0}
    assert s["correct"] is True and s["phases"]["variants"]["rc"] == 124
    r = s["recommended"]
    assert (r["attention"], r["symbolic_read_len"], r["fused_projections"], r["coordinate_descent_tuning"]) == (
        "split_key", True, True, True)
    # A failing check, or one that never ran, makes the run not correct.
    bad = {"phase": "c", "kind": "correct", "check": "attention", "ok": False}
    assert gc.summarize([*rows, bad])["correct"] is False
    assert gc.summarize([r for r in rows if r.get("check") != "greedy_embedded"])["correct"] is False
    # A formulation that failed to compile is never recommended.
    failed = {"phase": "model", "kind": "formulations_failed", "failed": {"split_key": "x"}}
    assert gc.summarize([*rows, failed])["recommended"]["attention"] == "flex"


def test_bytes_a_step_reads(monkeypatch) -> None:
    gc = _load(monkeypatch)
    model = Llama(gc.TINY)  # untied: the embedding table is gathered from (one row read), the head read whole
    assert not gc.TINY.tie_word_embeddings
    expected = 4 * (sum(p.numel() for p in model.parameters()) - 256 * 64 + 64)
    assert gc.weight_bytes_per_token(model) == expected
    assert gc.kv_bytes(gc.TINY, 10, torch.float32) == 2 * 2 * 2 * 10 * 16 * 4


def test_gpu_check_tp_two_gloo_ranks(tmp_path, monkeypatch) -> None:
    gc = _load(monkeypatch)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # two ranks on a small CPU: one thread each
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT_TP),
           "--tiny", "--device", "cpu", "--backend", "eager", "--steps", "2", "--out", str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check_tp2.json", "gpu_check_tp2.md"]  # rank 0 only
    result = json.loads((tmp_path / "gpu_check_tp2.json").read_text())
    sh, cfg = gc.shape(tiny=True), gc.TINY
    assert (result["world"], result["backend"], result["steps"]) == (2, "gloo", 2)
    assert (result["compile"], result["cudagraphs"], result["fallbacks"]) == ("backend=eager", False, {})
    assert result["allreduce"] == {"calls_per_step": 2 * cfg.num_layers, "bytes_per_call": cfg.hidden_size * 4,
                                   "compiled": "backend=eager"}
    cases = {(c["live"], c["mode"]): c for c in result["cases"]}
    assert set(cases) == {(n, m) for n in sh.lengths for m in ("eager", "compiled")}
    for n in sh.lengths:
        assert cases[(n, "eager")]["read_len"] == n + 2
        assert n + 2 <= cases[(n, "compiled")]["read_len"] <= sh.max_len
        assert cases[(n, "compiled")]["read_len"] in result["ladder"]
    for c in cases.values():
        assert c["ms_per_token"] > 0 and c["allreduce_ms_per_step"] > 0 and c["fallback"] == ""
        # not pinned to <= 1: on a loaded CPU the all-reduces alone can take longer than a whole step did
        assert c["allreduce_share"] > 0 and math.isfinite(c["allreduce_share"])
        # the share is the ratio of the two recorded times (each scaled by 1e3 on its own: equal up to rounding)
        assert math.isclose(c["allreduce_share"], c["allreduce_ms_per_step"] / c["ms_per_token"], rel_tol=1e-9)
    # Each rank caches its KV heads only: [L, B, Hkv / world, max_len + 1 (the spare row), d] for K and V.
    assert result["kv_heads_per_rank"] == cfg.num_kv_heads // 2
    world1 = 2 * cfg.num_layers * cfg.num_kv_heads * (sh.max_len + 1) * cfg.head_dim * 4
    assert result["cache_bytes_per_rank"] * 2 == world1
    shard = Llama(cfg, tp=TensorParallel(rank=0, world=2))  # building a shard needs no process group
    assert result["weight_bytes_per_rank"] == gc.weight_bytes_per_token(shard) < gc.weight_bytes_per_token(
        Llama(cfg)
    )
    assert "| live | mode | read_len | ms/token | all-reduce ms/step | all-reduce share |" in (
        tmp_path / "gpu_check_tp2.md"
    ).read_text()


def test_gpu_check_tp_needs_torchrun(tmp_path, monkeypatch, capsys) -> None:
    _load(monkeypatch)
    tp_check = _load(monkeypatch, SCRIPT_TP)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT_TP), "--tiny", "--device", "cpu", "--out", str(tmp_path)])
    assert tp_check.main() == 2
    assert "needs torchrun" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
