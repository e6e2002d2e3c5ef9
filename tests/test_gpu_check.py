"""profiles/gpu_check.py's logic runs on CPU (a tiny shape), so the GPU run cannot fail on a plain bug.

Pins: every (live length, mode) case is measured and written to JSON and markdown; the compiled cases read
their ladder bucket (>= live + steps, never past max_len) and "full" reads max_len; the bandwidth figures
are computed from the bytes the step reads; the cache and lengths are left empty afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "profiles" / "gpu_check.py"


def _load(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # dataclasses look their module up by name
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
    # bytes read per token: every weight once, except the untied embedding table, of which one row is gathered
    model = gc.Llama(gc.TINY)
    assert not gc.TINY.tie_word_embeddings
    expected = 4 * (sum(p.numel() for p in model.parameters()) - 256 * 64 + 64)
    assert result["weight_bytes"] == gc.weight_bytes_per_token(model) == expected
    assert gc.kv_bytes(gc.TINY, 10, torch.float32) == 2 * 2 * 2 * 10 * 16 * 4
    assert "| live | mode | read_len |" in (tmp_path / "gpu_check.md").read_text()
