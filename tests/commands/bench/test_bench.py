"""`static-decode bench`: the timing loop, the JSON it writes, the plot, and that every system decodes the same.

Pins: prefill and decode are timed apart per request and reduced by the median over the timed requests only
(warm-up requests are not timed), with the systems taking turns request by request; a system that emits the
wrong number of tokens is refused; every system (static-decode compiled, eager, full-read, concat,
transformers) gives transformers' own greedy continuation (an independent reference) on a tiny checkpoint
(llama.cpp needs a GGUF: here it is skipped with a note; tests/profiles/test_smollm2.py runs it where it can), and a
mismatch with static-decode is reported with its first index; the JSON has the documented keys; the plot is
a PNG; `--profile` writes a Chrome trace for bench and for generate; bad sweeps are refused naming the value.
No timing thresholds: the numbers are only checked to be what the fake clock dictates, or positive.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from capture import CompileSettings
from static_decode.commands import cli
from static_decode.commands.bench import command as bench
from static_decode.commands.bench import config as bench_config
from static_decode.commands.bench import machine as bench_machine
from static_decode.commands.bench import report as bench_report
from static_decode.commands.bench import run as bench_run
from static_decode.commands.bench import systems as bench_systems
from static_decode.commands.bench import timing as bench_timing
from tests.support.checkpoints import hf_greedy, hf_llama, save

EAGER = CompileSettings(backend="eager")  # dynamo only: the compiled systems' logic, without inductor's minutes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = hf_llama(seed=7, eos=None, layers=2)
    return model, save(model, tmp_path_factory.mktemp("bench"))


# ---- the timing loop, on a fake clock ------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeSystem:
    """Prefill costs `prefill` s, each decode step `step` s; tokens are 0, 1, 2, ... plus an offset."""

    def __init__(self, name: str, clock: FakeClock, prefill: float, step: float, log: list, offset: int = 0):
        self.name, self.mode, self.clock, self.log = name, "fake", clock, log
        self.prefill, self.step, self.offset, self.calls = prefill, step, offset, 0

    def start(self, prompt: list[int], new_tokens: int) -> None:
        self.calls += 1
        self.n = new_tokens
        self.clock.now += self.prefill * self.calls  # requests get slower: 1x, 2x, 3x ... (the median picks)
        self.log.append((self.name, len(prompt)))

    def finish(self) -> list[int]:
        self.clock.now += self.step * (self.n - 1) * self.calls
        return [self.offset + i for i in range(self.n)]


def test_timing_loop_medians_over_timed_requests_only_and_interleaves():
    clock, log = FakeClock(), []
    a = FakeSystem("a", clock, prefill=0.010, step=0.001, log=log)
    b = FakeSystem("b", clock, prefill=0.020, step=0.004, log=log, offset=5)
    gated, ticks = [], []
    t = bench_timing.time_interleaved([a, b], {3: [1, 2, 3], 5: [1, 2, 3, 4, 5]}, steps=4, repeats=3, warmup=2,
                                   clock=clock, gate=lambda: gated.append(len(log)), tick=ticks.append)
    # 2 warm-up rounds then 3 timed, each round every context in turn and, within it, every system in turn.
    assert log == [("a", 3), ("b", 3), ("a", 5), ("b", 5)] * 5
    assert gated == list(range(8, 20))  # the idle gate runs before each timed request only
    assert ticks == [3, 3, 5, 5] * 3
    # a's calls alternate contexts: its timed requests at context 3 are calls 5, 7, 9 (prefill 5x, 7x, 9x the
    # base, median 7x; per token likewise), at context 5 calls 6, 8, 10.
    assert t[3]["a"].prefill_s == pytest.approx([0.050, 0.070, 0.090])
    assert t[3]["a"].prefill_ms() == pytest.approx(70.0)
    assert t[3]["a"].ms_per_token() == pytest.approx(7.0)
    assert t[3]["a"].ms_per_token(min) == pytest.approx(5.0)
    assert t[5]["a"].ms_per_token() == pytest.approx(8.0)
    assert t[5]["b"].ms_per_token() == pytest.approx(32.0)
    assert t[5]["b"].tokens == [5, 6, 7, 8, 9]  # steps + 1 new tokens, from the first timed request


def test_idle_gate_waits_for_idle_cpus_and_counts_when_it_gives_up(monkeypatch):
    readings = iter([0.2, 0.5, 0.95])
    monkeypatch.setattr(bench_timing.IdleGate, "idle_fraction", staticmethod(lambda: next(readings)))
    gate = bench_timing.IdleGate(limit_s=60)
    gate()  # busy, busy, idle: returns after the third reading
    assert next(readings, None) is None and gate.stats["gave_up"] == 0 and gate.stats["requests"] == 1
    monkeypatch.setattr(bench_timing.IdleGate, "idle_fraction", staticmethod(lambda: 0.0))
    impatient = bench_timing.IdleGate(limit_s=1e-9)
    impatient()
    assert impatient.stats["gave_up"] == 1
    off = bench_timing.IdleGate(limit_s=0)
    off()
    assert off.stats["requests"] == 0  # off: not even a /proc/stat read


def test_a_system_emitting_the_wrong_number_of_tokens_is_refused():
    clock = FakeClock()
    s = FakeSystem("short", clock, 0.0, 0.0, [])
    s.finish = lambda: [1]
    with pytest.raises(RuntimeError, match="short emitted 1 tokens, expected 4"):
        bench_timing.request(s, [1], 3, None, clock)


def test_a_token_mismatch_is_reported_with_its_first_index():
    ref, other = bench_timing.Timing(3, [0.1], [0.3], [4, 5, 6, 7]), bench_timing.Timing(3, [0.1], [0.3], [4, 5, 9, 7])
    s = FakeSystem("x", FakeClock(), 0, 0, [])
    row = bench_run._row(s, other, 10, 64, ref)
    assert (row["tokens_match"], row["first_mismatch"]) == (False, 2)
    assert bench_run._row(s, ref, 10, 64, ref)["tokens_match"] is True
    assert bench_run._row(s, ref, 10, 64, None)["tokens_match"] is None  # static-decode did not run


# ---- the systems on a tiny checkpoint ------------------------------------------------------------------------
def test_every_system_gives_the_reference_greedy_tokens(checkpoint):
    hf, path = checkpoint
    from static_decode.checkpoints.loading import load_model

    model = load_model(path)
    prompt, _ = bench_run.make_prompt(path, model.config.vocab_size, 21)
    want = hf_greedy(hf, prompt, 7, eos=None)  # transformers' generate: independent of every system below
    for name in bench_systems.SYSTEMS:
        system, why = bench_systems.build(name, model, path=path, max_len=40, settings=EAGER,
                                          transformers_compile=False)
        if name == "llama.cpp":  # needs a GGUF (tests/profiles/test_smollm2.py converts one where it can)
            assert system is None and why.startswith("skipped: "), why
            continue
        assert system is not None, why
        for _ in range(2):  # the second request reuses the system's cache: it must start from scratch
            assert bench_timing.request(system, prompt, 6, None) == want, name


def test_transformers_compiled_decode_step_gives_the_same_tokens(checkpoint):
    hf, path = checkpoint
    from static_decode.checkpoints.loading import load_model

    model = load_model(path)
    system = bench_systems.TransformersSystem(path, model.dtype, model.device, 40, compile=True, backend="eager")
    assert "torch.compile(backend='eager', fullgraph=True)" in system.mode  # it did not fall back to eager
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert bench_timing.request(system, prompt, 5, None) == hf_greedy(hf, prompt, 6, eos=None)


def test_bench_run_json_plot_and_profile(checkpoint, tmp_path, capsys):
    _, path = checkpoint
    out, png, trace = tmp_path / "b.json", tmp_path / "b.png", tmp_path / "trace.json"
    rc = cli.main([
        "bench", "--model", str(path), "--contexts", "5,20", "--max-len", "32", "--steps", "4", "--repeats", "2",
        "--warmup", "1", "--compile-backend", "eager", "--no-transformers-compile", "--attention-lengths", "64",
        "--threads", "1", "--quiet", "--json", str(out), "--plot", str(png), "--profile", str(trace),
    ])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc) >= {"machine", "model", "bench", "systems", "rows", "attention", "checks", "notes"}
    assert set(doc["machine"]) >= {"cpu", "cores", "threads", "torch", "load_avg_before", "load_avg_after"}
    assert doc["machine"]["threads"] == 1
    assert doc["model"]["layers"] == 2 and doc["model"]["kv_heads"] == 2
    assert doc["bench"]["command"].startswith("static-decode bench --contexts 5,20 --max-len 32 --steps 4")
    assert [s["system"] for s in doc["systems"]] == list(bench_systems.SYSTEMS)
    ran = [n for n in bench_systems.SYSTEMS if n != "llama.cpp"]  # no --gguf: llama.cpp is skipped with a note
    assert all("mode" in s and s["setup_s"] >= 0 for s in doc["systems"] if s["system"] in ran)
    assert doc["systems"][-1]["skipped"].startswith("skipped: ")
    assert any(n.startswith("llama.cpp: skipped: ") for n in doc["notes"])
    assert [(r["system"], r["context"]) for r in doc["rows"]] == [(s, c) for c in (5, 20) for s in ran]
    for r in doc["rows"]:
        assert set(r) >= {"system", "context", "max_len", "ms_per_token", "prefill_ms", "tokens_match"}
        assert r["max_len"] == 32 and r["ms_per_token"] > 0 and r["prefill_ms"] > 0 and r["repeats"] == 2
        assert r["tokens_match"] is True, r
    full = {r["context"]: r["read_len"] for r in doc["rows"] if r["system"] == "full-read"}
    assert full == {5: 32, 20: 32}  # full-read always reads max_len
    # asked for + this sweep's max_len (one rung), for every formulation that runs eagerly (flex: CUDA, compiled)
    assert {(r["impl"], r["length"]) for r in doc["attention"]} == {
        (i, n) for i in ("matmul", "sdpa", "matmul_qk", "sdpa_folded", "split_key", "decode_kernel") for n in (64, 32)}
    for r in doc["attention"]:
        assert set(r) >= {"length", "ms", "gbps", "bandwidth_fraction"} and r["ms"] > 0
    assert "transformers_over_static_decode" in doc["checks"]
    bw = doc["bandwidth"]
    assert bw["read_gbps_before"] > 0 and bw["read_gbps_after"] > 0
    assert [(b["system"], b["context"]) for b in doc["bound"]] == [(r["system"], r["context"]) for r in doc["rows"]]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "traceEvents" in json.loads(trace.read_text())
    printed = capsys.readouterr().out
    assert "transformers_over_static_decode: ratio" in printed and "full-read" in printed


def test_generate_profile_writes_a_chrome_trace(checkpoint, tmp_path, capsys):
    _, path = checkpoint
    trace = tmp_path / "gen.json"
    rc = cli.main(["generate", "--model", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                   "--device", "cpu", "--profile", str(trace)])
    assert rc == 0 and "traceEvents" in json.loads(trace.read_text())
    assert str(trace) in capsys.readouterr().err


def test_llama_cpp_is_skipped_with_a_note_without_the_package_or_a_gguf(checkpoint, monkeypatch, tmp_path):
    _, path = checkpoint
    from static_decode.checkpoints.loading import load_model

    model = load_model(path)
    find_spec = bench_systems.importlib.util.find_spec
    monkeypatch.setattr(bench_systems.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else find_spec(name, *a))
    gguf = tmp_path / "m.gguf"
    system, why = bench_systems.build("llama.cpp", model, path=path, max_len=40, gguf=gguf, threads=1)
    assert system is None and "llama-cpp-python is not installed" in why and "[llamacpp]" in why
    monkeypatch.setattr(bench_systems.importlib.util, "find_spec", lambda name, *a: object())  # "installed"
    system, why = bench_systems.build("llama.cpp", model, path=path, max_len=40, gguf=None, threads=1)
    assert system is None and "no --gguf PATH" in why


def test_gguf_option_reaches_the_config_and_the_command(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    config = bench.config_from_args(_args("--gguf", str(gguf), "--systems", "static-decode,llama.cpp"))
    assert config.gguf == (bench_config.GGUFFile(gguf),) and config.systems == ("static-decode", "llama.cpp")
    assert f"--gguf {gguf}" in config.command(1)
    assert "llama.cpp" not in bench_systems.TP_SYSTEMS  # one process: skipped under torchrun
    with pytest.raises(FileNotFoundError, match="--gguf .*missing.gguf: no such file"):
        bench_config.BenchConfig(gguf=tmp_path / "missing.gguf")
    bench_config.BenchConfig(gguf=tmp_path / "missing.gguf", systems=("static-decode",))  # not used: not checked


def test_kv_dtype_option_reaches_the_config_the_command_and_the_model(checkpoint):
    _, path = checkpoint
    config = bench.config_from_args(_args(
        "--model", str(path), "--kv-dtype", "bfloat16", "--no-attention", "--systems", "static-decode",
        "--contexts", "8", "--max-len", "32", "--steps", "2", "--repeats", "1", "--warmup", "0",
        "--compile-backend", "eager", "--threads", "1", "--quiet",
    ))
    assert config.kv_dtype == "bfloat16" and "--kv-dtype bfloat16" in config.command(1)
    with pytest.raises(SystemExit):
        _args("--kv-dtype", "int4")  # not a cache dtype (int8 is)
    doc = bench_run.run(config)
    assert (doc["model"]["dtype"], doc["model"]["kv_dtype"]) == ("float32", "bfloat16")
    assert doc["rows"] and doc["rows"][0]["ms_per_token"] > 0


# ---- options and refusals ------------------------------------------------------------------------------------
def _args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["bench", *argv])


def test_quick_sets_a_short_sweep_unless_told_otherwise():
    config = bench.config_from_args(_args("--quick"))
    assert (config.contexts, config.steps, config.repeats) == (
        bench_config.QUICK["contexts"], bench_config.QUICK["steps"], bench_config.QUICK["repeats"]
    )
    assert bench.config_from_args(_args("--quick", "--contexts", "64")).contexts == (64,)
    assert bench.config_from_args(_args("--no-attention")).attention_lengths is None
    assert bench.config_from_args(_args()).settings is None  # the device default of capture/


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"contexts": (2000,), "max_len": 2048, "steps": 64}, "context 2000 does not fit"),
        ({"contexts": (0,)}, "context 0 does not fit"),
        ({"contexts": ()}, "contexts must be distinct and at least one"),
        ({"contexts": (128, 512, 128)}, "contexts must be distinct"),
        ({"systems": ("static-decode", "vllm")}, "systems must be distinct names"),
        ({"steps": 0}, "steps must be an int >= 1, got 0"),
    ],
)
def test_bad_sweeps_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bench_config.BenchConfig(**kwargs)


def test_cli_reports_a_bad_sweep_as_a_usage_error(capsys):
    assert cli.main(["bench", "--contexts", "4000"]) == 2
    assert "context 4000 does not fit" in capsys.readouterr().err


def test_checks_from_rows():
    rows = [
        {"system": "static-decode", "context": 128, "ms_per_token": 1.0},
        {"system": "transformers", "context": 128, "ms_per_token": 3.5},
        {"system": "full-read", "context": 128, "ms_per_token": 1.1},
        {"system": "static-decode", "context": 512, "ms_per_token": 2.0},
        {"system": "transformers", "context": 512, "ms_per_token": 5.0},
    ]
    attention = [{"length": 256, "ms": 0.5}, {"length": 2048, "ms": 3.0}]
    doc = {"bench": {"contexts": [128, 512], "max_len": 2048}, "rows": rows, "attention": attention}
    t = bench_report.checks(doc)
    assert t["transformers_over_static_decode"]["by_context"] == [
        {"context": 128, "ratio": 3.5}, {"context": 512, "ratio": 2.5}
    ]
    assert "met" not in t["transformers_over_static_decode"]  # a ratio, not a check
    assert t["full_read_over_static_decode_at_max_len_16"] == {
        "context": 128, "ratio": 1.1, "expect": "clearly > 1 (counted from 1.2)", "met": False
    }
    (check,) = t["attention_bucket_over_max_len"]["checks"]
    assert (check["bucket"], check["ideal_ratio"], check["over_ideal"]) == (256, 0.125, 1.33)
    assert check["met"] is False
    assert "long_context_over_bytes" not in t  # no model facts in this document


def test_long_context_check_from_the_bytes_ratio():
    # 1,000 float32 parameters = 4,000 B; one token's K/V = 2 x 2 layers x 1 head x 10 x 4 B = 160 B.
    model = {"parameters": 1000, "dtype": "float32", "layers": 2, "kv_heads": 1, "head_dim": 10}
    assert bench_report.bytes_per_token(model, 25) == 4000 + 25 * 160
    rows = [
        {"system": "static-decode", "context": 0, "ms_per_token": 2.0},
        {"system": "static-decode", "context": 25, "ms_per_token": 4.0},  # ideal 2x, measured 2x
        {"system": "static-decode", "context": 50, "ms_per_token": 8.0},  # ideal 3x, measured 4x: over 1.25
        {"system": "llama.cpp", "context": 50, "ms_per_token": 10.0},
    ]
    doc = {"bench": {"contexts": [0, 25, 50], "max_len": 64}, "rows": rows, "model": model}
    g = bench_report.checks(doc)["long_context_over_bytes"]
    assert [(x["context"], x["ideal_ratio"], x["measured_ratio"], x["met"]) for x in g["by_context"]] == [
        (25, 2.0, 2.0, True), (50, 3.0, 4.0, False)
    ]
    assert g["by_context"][1]["llama_cpp_over_static_decode"] == 1.25 and g["met"] is False
    # a bfloat16 cache for the float32 model (--kv-dtype): the live K/V count at 2 bytes
    assert bench_report.bytes_per_token({**model, "kv_dtype": "bfloat16"}, 25) == 4000 + 25 * 80



def test_bound_is_the_bytes_floor_over_each_row():
    # 1,000 float32 parameters = 4,000 B; one token's K/V = 160 B (see above). Read bandwidth: mean of 3 and 5.
    model = {"parameters": 1000, "dtype": "float32", "layers": 2, "kv_heads": 1, "head_dim": 10}
    rows = [
        {"system": "static-decode", "context": 25, "ms_per_token": 0.002},  # 8,000 B in 2 us = 4 GB/s
        {"system": "transformers", "context": 25, "ms_per_token": 0.008},  # 1 GB/s
    ]
    doc = {"rows": rows, "model": model, "bandwidth": {"read_gbps_before": 3.0, "read_gbps_after": 5.0}}
    assert bench_report.bound(doc) == [
        {"system": "static-decode", "context": 25, "bytes_per_token": 8000, "gbps": 4.0, "read_fraction": 1.0},
        {"system": "transformers", "context": 25, "bytes_per_token": 8000, "gbps": 1.0, "read_fraction": 0.25},
    ]
    assert bench_report.bound({"rows": rows, "model": model}) == []  # no probe: no bound rows


def test_read_bandwidth_is_bytes_over_the_best_sum():
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 3.0])  # sums of 0.5, 0.25 and 1.0 s: the best is 0.25
    gbps = bench_machine.read_bandwidth(torch.device("cpu"), nbytes=4 * 1000, repeats=3, clock=lambda: next(ticks))
    assert gbps == pytest.approx(4000 / 0.25 / 1e9)


def test_a_request_form_is_judged_by_the_ratio_it_shows():
    """A form 1.1004x as slow as plain greedy shows 1.1 and meets the 1.1 slack; 1.1006x shows 1.101 and does not."""
    rows = [{"system": "static-decode", "context": 8, "ms_per_token": 10.0},
            {"system": "static-decode min-p", "context": 8, "ms_per_token": 11.004},
            {"system": "static-decode logprobs", "context": 8, "ms_per_token": 11.006}]
    systems = [{"system": "static-decode"}, {"system": "static-decode min-p", "request": "min-p"},
               {"system": "static-decode logprobs", "request": "logprobs"}]
    doc = {"bench": {"contexts": [8], "max_len": 16}, "rows": rows, "systems": systems}
    forms = bench_report.checks(doc)["request_forms_over_greedy"]["by_context"]
    assert [(f["system"], f["ratio"], f["met"]) for f in forms] == [
        ("static-decode min-p", 1.1, True), ("static-decode logprobs", 1.101, False)]
