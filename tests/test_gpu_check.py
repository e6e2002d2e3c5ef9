"""profiles/gpu_check.py's logic runs on CPU (a tiny shape), so the GPU run cannot fail on a plain bug.

Pins: every (live length, mode) case is measured and written to JSON and markdown; the compiled cases read
their ladder bucket (>= live + steps, never past max_len) and "full" reads max_len; the bandwidth figures
are computed from the bytes the step reads; the cache and lengths are left empty afterwards.

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

from static_decode.parallel import TensorParallel

SCRIPT = Path(__file__).resolve().parents[1] / "profiles" / "gpu_check.py"
SCRIPT_TP = SCRIPT.with_name("gpu_check_tp.py")


def _load(monkeypatch, script: Path = SCRIPT):
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, script.stem, module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_gpu_check_tiny_on_cpu(tmp_path, monkeypatch) -> None:
    gc = _load(monkeypatch)
    torch._dynamo.reset()
    argv = [str(SCRIPT), "--tiny", "--device", "cpu", "--backend", "eager", "--steps", "2", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        assert gc.main() == 0
    finally:
        torch._dynamo.reset()
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    sh = gc.shape(tiny=True)
    assert result["max_len"] == sh.max_len and result["steps"] == 2
    cases = {(c["live"], c["mode"]): c for c in result["cases"]}
    assert set(cases) == {(n, m) for n in sh.lengths for m in ("eager", "graphs", "full")}
    for n in sh.lengths:
        assert cases[(n, "eager")]["read_len"] == n + 2
        assert n + 2 <= cases[(n, "graphs")]["read_len"] <= sh.max_len
        assert cases[(n, "graphs")]["read_len"] in result["ladder"]
        assert cases[(n, "full")]["read_len"] == sh.max_len
    for c in cases.values():
        assert c["ms_per_token"] > 0 and c["useful_gb_per_s"] > 0 and c["fraction_of_copy"] > 0
    # the attention rows: every eager impl at every live length (flex only compiled on CUDA), fraction of copy
    from static_decode.attention import IMPLS

    rows = {(r["impl"], r["length"]): r for r in result["attention"]}
    assert set(rows) == {(i, n) for i in IMPLS if i != "flex" for n in sh.lengths}
    copy_gbps = result["copy_bytes_per_s"] / 1e9
    for r in rows.values():  # the fraction is rounded to 3 places
        assert math.isclose(r["bandwidth_fraction"], r["gbps"] / copy_gbps, rel_tol=2e-2, abs_tol=6e-4)
    assert "decode attention alone" in (tmp_path / "gpu_check.md").read_text()
    # bytes read per token: every weight once, except the untied embedding table, of which one row is gathered
    model = gc.Llama(gc.TINY)
    assert not gc.TINY.tie_word_embeddings
    expected = 4 * (sum(p.numel() for p in model.parameters()) - 256 * 64 + 64)
    assert result["weight_bytes"] == gc.weight_bytes_per_token(model) == expected
    assert gc.kv_bytes(gc.TINY, 10, torch.float32) == 2 * 2 * 2 * 10 * 16 * 4
    assert "| live | mode | read_len |" in (tmp_path / "gpu_check.md").read_text()


def test_an_attention_impl_that_fails_costs_only_its_rows(monkeypatch) -> None:
    """A formulation that raises on the device (split_key's CUDA kernel is unrun so far) is recorded as failed
    rows, named in the table, and the other impls are still measured."""
    gc = _load(monkeypatch)
    from static_decode.commands.bench_systems import load_profiles_module

    ab = load_profiles_module("attention_bench")
    real = ab.attention_rows

    def rows(lengths, impls, **kw):
        if impls == ("split_key",):
            raise RuntimeError("no kernel image\nmore")
        return real(lengths, impls, **kw)

    monkeypatch.setattr(ab, "attention_rows", rows)
    monkeypatch.setattr("static_decode.commands.bench_systems.load_profiles_module", lambda name: ab)
    sh = gc.shape(tiny=True)
    got = gc.attention(sh, 2, torch.device("cpu"), 10e9, "eager")
    failed = [r for r in got if "error" in r]
    assert failed == [{"impl": "split_key", "length": n, "error": "RuntimeError: no kernel image"} for n in sh.lengths]
    measured = {r["impl"] for r in got if "error" not in r}
    assert measured == {"matmul", "sdpa", "matmul_qk", "sdpa_folded", "decode_kernel"}
    head = {"shape": "tiny", "device": "cpu", "torch": torch.__version__, "batch": 1, "max_len": sh.max_len,
            "dtype": "float32", "steps": 2}
    md = gc.table({**head, "cases": [], "attention": got})
    assert f"| split_key | {sh.lengths[0]} | failed: RuntimeError: no kernel image | | |" in md


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
    shard = gc.Llama(cfg, tp=TensorParallel(rank=0, world=2))  # building a shard needs no process group
    assert result["weight_bytes_per_rank"] == gc.weight_bytes_per_token(shard) < gc.weight_bytes_per_token(
        gc.Llama(cfg)
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
