"""`static-decode capture-report`: the committed baseline for the embedded default model still holds.

Pins: compiling the embedded default model's greedy steps (max_len 64: one bucket) gives exactly the graphs,
graph breaks and cudagraph skips recorded in capture/baselines/default_model_cpu.json (which covers every kind;
the check compares the kinds that were compiled); `--check` exits 1 and names the pair and field on a
difference, a missing or extra pair; an unreadable baseline is refused before anything compiles; JSON round
trips. One inductor compile (3 graphs) serves the module.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import static_decode.commands.capture_report as report_mod
from capture.report import CaptureRecord, CaptureReport
from static_decode.commands.cli import main

BASELINE = Path(__file__).resolve().parents[2] / "capture" / "baselines" / "default_model_cpu.json"
ARGS = ["capture-report", "--max-len", "64", "--chunk-size", "16", "--kinds", "prefill,first_greedy,decode_greedy"]


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """Run the command once against the committed baseline: (exit code, report JSON)."""
    log = logging.getLogger("torch.__trace")  # see tests/capture/test_capture.py: keeps compile time down under pytest
    saved, log.propagate = log.propagate, False
    torch._dynamo.reset()
    out = tmp_path_factory.mktemp("report") / "report.json"
    try:
        code = main([*ARGS, "--device", "cpu", "--quiet", "--json", str(out), "--check", str(BASELINE)])
    finally:
        log.propagate = saved
        torch._dynamo.reset()
    return code, json.loads(out.read_text())


def test_default_model_matches_committed_baseline(checked) -> None:
    code, data = checked
    assert code == 0
    pairs = {(r["kind"], r["read_len"]): r for r in data["records"]}
    assert set(pairs) == {("prefill", 64), ("first_greedy", 0), ("decode_greedy", 64)}
    assert all((r["graphs"], r["graph_breaks"], r["cudagraph_skips"]) == (1, 0, 0) for r in pairs.values())
    assert (data["max_len"], data["ladder"], data["model"]) == (64, [64], "embedded default")


def _edited(tmp_path: Path, edit) -> Path:
    data = json.loads(BASELINE.read_text())
    edit(data["records"])
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda rs: rs[-1].update(graphs=2), "decode_greedy @ 64: graphs = 1, baseline 2"),
        (lambda rs: rs[0].update(graph_breaks=1), "prefill @ 64: graph_breaks = 0, baseline 1"),
        (lambda rs: rs.append(dict(rs[-1], read_len=32)), "('decode_greedy', 32) is in the baseline but was not"),
        (lambda rs: rs.remove(rs[-1]), "('decode_greedy', 64) was compiled but is not in the baseline"),
    ],
)
def test_check_fails_and_names_the_difference(checked, tmp_path, monkeypatch, capsys, edit, message) -> None:
    _, data = checked
    monkeypatch.setattr(report_mod, "build_report", lambda *a, **k: CaptureReport.from_json(data))  # no compile
    baseline = _edited(tmp_path, edit)
    assert main([*ARGS, "--device", "cpu", "--quiet", "--check", str(baseline)]) == 1
    assert message in capsys.readouterr().err


def test_unreadable_baseline_is_refused_before_compiling(tmp_path, monkeypatch, capsys) -> None:
    def must_not_compile(*a, **k):
        raise AssertionError("compiled before reading the baseline")

    monkeypatch.setattr(report_mod, "build_report", must_not_compile)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main([*ARGS, "--quiet", "--check", str(bad)]) == 2
    assert "cannot read capture baseline" in capsys.readouterr().err
    bad.write_text(json.dumps({"records": [{"kind": "decode"}]}))
    assert main([*ARGS, "--quiet", "--check", str(bad)]) == 2
    assert "not a capture report" in capsys.readouterr().err


def test_json_round_trip_and_differences() -> None:
    rec = CaptureRecord("decode", 64, 1.23456, 1, 0, 0, 0, None)
    report = CaptureReport([rec], seconds=2.0, settings="mode=default", device="cpu", meta={"max_len": 64})
    back = CaptureReport.from_json(json.loads(json.dumps(report.to_json())))
    assert back.records == [CaptureRecord("decode", 64, 1.235, 1, 0, 0, 0, None)]
    assert back.meta["max_len"] == 64 and back.meta["torch"] == torch.__version__
    assert report.differences(back) == []
    other = CaptureReport([CaptureRecord("decode", 64, 9.0, 1, 0, 3, 1, 5)], seconds=9.0)
    assert report.differences(other) == ["decode @ 64: cudagraph_skips = 0, baseline 1"]  # seconds etc. ignored


def test_region_graphs_are_counted_apart_and_not_checked_per_pair() -> None:
    """Layer-region graphs go to whichever pair first ran a chunk shape: counted in the totals, shown apart in the
    summary, and not compared per pair (a baseline of every kind holds them on other pairs than a greedy run)."""
    records = [CaptureRecord("prefill", 64, 1.0, 1, 0, 0, 0, region_graphs=1),
               CaptureRecord("first_greedy", 0, 1.0, 1, 0, 0, 0),
               CaptureRecord("decode_greedy", 64, 1.0, 1, 0, 0, 0, region_graphs=1)]
    report = CaptureReport(records, seconds=3.0, settings="s", device="cpu")
    assert (report.graphs, report.region_graphs) == (5, 2)
    assert report.summary().startswith(
        "3 (kind, bucket) pairs in 3.0 s: 3 step graphs (prefill 1 for 1 bucket, first_greedy 1 for 1 bucket, "
        "decode_greedy 1 for 1 bucket) + 2 layer-region graphs, 0 graph breaks")
    moved = [records[0], records[1], CaptureRecord("decode_greedy", 64, 1.0, 1, 0, 0, 0, region_graphs=0)]
    assert report.differences(CaptureReport(moved, seconds=1.0)) == []
    assert report.differences(CaptureReport([*records[:2], CaptureRecord("decode_greedy", 64, 1.0, 2, 0, 0, 0)],
                                            seconds=1.0)) == ["decode_greedy @ 64: graphs = 1, baseline 2"]
