"""`static-decode bench` with several weight forms side by side: --quantize none,int8,... (static-decode's forms)
and several --gguf files (llama.cpp's quants).

Pins: both options take several values (comma-separated; --gguf also repeated and NAME=PATH) and the single form
still works; a missing GGUF is one line naming it before any model loads; the systems' names (plain with one form
or one unnamed GGUF, else suffixed by form, NAME or the file's quant type); each system's bytes floor counts its
own weight bytes; the ratios to the first system; a real run on the embedded model with none,int8 (int8 reads
fewer bytes than float, each exactly what static_decode.model.quant.read_bytes counts of an independently loaded model);
and, where llama-cpp-python and gguf are installed, a real run beside llama.cpp on tiny GGUFs written here and
quantized by llama.cpp's own quantizer (profiles/smollm2.py's quantize_gguf), their tensor bytes checked against
the GGUF block formats (F32: 4 B a weight; Q8_0: 34 B per 32 weights).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from static_decode.base import hugepages
from static_decode.checkpoints.loading import default_model_path, load_model
from static_decode.commands import cli
from static_decode.commands.bench import command as bench
from static_decode.commands.bench import config as bench_config
from static_decode.commands.bench import lineup as bench_lineup
from static_decode.commands.bench import peer as bench_peer
from static_decode.commands.bench import report as bench_report
from static_decode.commands.bench import run as bench_run
from static_decode.commands.bench.config import GGUFFile
from static_decode.commands.bench.lineup import GGUFFacts
from static_decode.model import quant
from tests.support.checkpoints import llama_cpp_system_info, tiny_gguf

ROOT = Path(__file__).resolve().parents[3]
TINY = ["--contexts", "5,12", "--max-len", "24", "--steps", "2", "--repeats", "1", "--warmup", "0",
        "--compile-backend", "eager", "--no-attention", "--threads", "1", "--quiet"]


def _args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["bench", *argv])


def _files(tmp_path: Path, *names: str) -> list[Path]:
    out = []
    for n in names:
        (tmp_path / n).write_bytes(b"GGUF")
        out.append(tmp_path / n)
    return out


# ---- options -------------------------------------------------------------------------------------------------
def test_gguf_takes_several_files_comma_separated_repeated_and_named(tmp_path):
    a, b, c = _files(tmp_path, "a.gguf", "b.gguf", "c=odd.gguf")
    config = bench.config_from_args(_args("--gguf", f"{a}, {b}", "--gguf", f"Q8_0={c}"))
    assert config.gguf == (GGUFFile(a), GGUFFile(b), GGUFFile(c, "Q8_0"))
    assert f"--gguf {a},{b},Q8_0={c}" in config.command(1)
    assert bench.config_from_args(_args("--gguf", str(c))).gguf == (GGUFFile(c),)  # an existing file with "="
    assert bench.config_from_args(_args()).gguf == ()
    missing = bench.config_from_args(_args("--gguf", f"{a},{tmp_path / 'no.gguf'}", "--systems", "static-decode"))
    assert len(missing.gguf) == 2  # llama.cpp does not run: its files are not looked at
    with pytest.raises(ValueError, match="NAME=PATH"):
        bench_config.BenchConfig(gguf="Q 8=x.gguf")
    with pytest.raises(ValueError, match="given twice"):
        bench_config.BenchConfig(gguf=f"{a},X={a}")
    with pytest.raises(ValueError, match="NAME= must differ"):
        bench_config.BenchConfig(gguf=f"X={a},X={b}")


def test_quantize_takes_several_forms_and_the_single_form_still_works():
    config = bench.config_from_args(_args("--quantize", "none,int8, INT4"))
    assert config.quantize == ("none", "int8", "int4") and config.forms == config.quantize
    assert "--quantize none,int8,int4" in config.command(1)
    single = bench.config_from_args(_args("--quantize", "int8"))
    assert single.quantize == ("int8",) and "--quantize int8" in single.command(1)
    plain = bench.config_from_args(_args())
    assert (plain.quantize, plain.forms) == ((), ("none",)) and "--quantize" not in plain.command(1)
    assert _args("--quantize", "int8").quantize == "int8"  # the option's text, as every command's --quantize
    with pytest.raises(ValueError, match="--quantize 'int3': choose from none, int8, int4"):
        bench_config.BenchConfig(quantize="none,int3")
    with pytest.raises(ValueError, match="'int4' and 'int4-g32' are the same form"):
        bench_config.BenchConfig(quantize=("int4", "int4-g32"))


def test_a_missing_gguf_is_one_line_before_any_model_loads(tmp_path, monkeypatch, capsys):
    (a,) = _files(tmp_path, "a.gguf")
    missing = tmp_path / "nope" / "b.gguf"
    monkeypatch.setattr(bench_run, "load_forms", lambda *a, **k: pytest.fail("a model was loaded"))
    rc = cli.main(["bench", "--gguf", str(a), "--gguf", f"Q4_0={missing}", "--systems", "static-decode,llama.cpp",
                   *TINY])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"static-decode bench: error: --gguf {missing}: no such file"]


# ---- names, floors and ratios --------------------------------------------------------------------------------
def test_system_names_follow_the_forms_and_the_gguf_types(tmp_path):
    a, b, c = _files(tmp_path, "a.gguf", "b.gguf", "c.gguf")
    facts = {a: GGUFFacts("Q8_0", 8, ""), b: GGUFFacts("Q4_0", 4, ""), c: GGUFFacts("Q8_0", 9, "")}

    def names(**kw):
        return [(p.name, p.reference) for p in bench_lineup.plan(bench_config.BenchConfig(**kw), facts)]

    assert names(systems=("static-decode", "concat", "llama.cpp")) == [
        ("static-decode", "static-decode"), ("concat", "static-decode"), ("llama.cpp", "static-decode")]
    assert names(systems=("static-decode", "full-read"), quantize="int8") == [  # one form: the plain names
        ("static-decode", "static-decode"), ("full-read", "static-decode")]
    assert names(systems=("static-decode", "full-read", "transformers"), quantize="int8,none") == [
        ("static-decode int8", "static-decode int8"), ("static-decode", "static-decode"),
        ("full-read int8", "static-decode int8"), ("full-read", "static-decode"),
        ("transformers", "static-decode int8")]  # compared with the first form's static-decode
    assert names(systems=("llama.cpp",), gguf=a) == [("llama.cpp", "static-decode")]  # one file: as before
    assert [n for n, _ in names(systems=("llama.cpp",), gguf=f"{a},{b},MINE={c}")] == [
        "llama.cpp Q8_0", "llama.cpp Q4_0", "llama.cpp MINE"]
    assert [n for n, _ in names(systems=("llama.cpp",), gguf=(a, b, c))] == [
        "llama.cpp Q8_0 (a.gguf)", "llama.cpp Q4_0", "llama.cpp Q8_0 (c.gguf)"]
    concat = bench_lineup.plan(bench_config.BenchConfig(systems=("concat",), quantize="none,int8"), {})
    assert [(p.name, bool(p.skip)) for p in concat] == [("concat", False), ("concat int8", True)]


def test_the_bytes_floor_counts_each_systems_own_weights():
    # 1,000 float32 parameters = 4,000 B (the model's); one token's K/V = 2 x 2 layers x 1 head x 10 x 4 B = 160 B.
    model = {"parameters": 1000, "dtype": "float32", "layers": 2, "kv_heads": 1, "head_dim": 10}
    systems = [{"system": "static-decode", "weight_bytes": 4000},
               {"system": "static-decode int8", "weight_bytes": 1200},
               {"system": "llama.cpp Q4_0", "weight_bytes": 700}, {"system": "concat"}]
    rows = [{"system": s["system"], "context": 25, "ms_per_token": 0.002} for s in systems]
    doc = {"rows": rows, "model": model, "systems": systems,
           "bandwidth": {"read_gbps_before": 4.0, "read_gbps_after": 4.0}}
    got = {b["system"]: (b["bytes_per_token"], b["gbps"]) for b in bench_report.bound(doc)}
    assert got == {"static-decode": (8000, 4.0), "static-decode int8": (5200, 2.6), "llama.cpp Q4_0": (4700, 2.35),
                   "concat": (8000, 4.0)}  # concat counted nothing of its own: the model's parameters
    legacy = {**model, "weight_bytes": 1500}  # an older document: one quantized count for the model
    assert bench_report.bound({**doc, "model": legacy, "systems": []})[0]["bytes_per_token"] == 1500 + 4000


def test_ratios_are_to_the_first_system():
    rows = [{"system": s, "context": c, "ms_per_token": ms, "prefill_ms": p} for s, c, ms, p in [
        ("static-decode", 8, 2.0, 10.0), ("static-decode int8", 8, 1.0, 12.5), ("llama.cpp Q8_0", 8, 3.0, 5.0),
        ("static-decode", 16, 4.0, 20.0), ("static-decode int8", 16, 3.0, 20.0), ("llama.cpp Q8_0", 16, 5.0, 8.0)]]
    rel = bench_report.relative({"rows": rows})
    assert rel["to"] == "static-decode"
    assert [(r["system"], r["context"], r["ms_per_token"], r["prefill_ms"]) for r in rel["rows"]] == [
        ("static-decode", 8, 1.0, 1.0), ("static-decode int8", 8, 0.5, 1.25), ("llama.cpp Q8_0", 8, 1.5, 0.5),
        ("static-decode", 16, 1.0, 1.0), ("static-decode int8", 16, 0.75, 1.0), ("llama.cpp Q8_0", 16, 1.25, 0.4)]
    assert bench_report.relative({"rows": []}) == {}


# ---- real runs -----------------------------------------------------------------------------------------------
def test_a_bench_of_two_forms_on_the_embedded_model(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert cli.main(["bench", "--quantize", "none,int8", "--systems", "static-decode,static-decode-eager", *TINY,
                     "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    names = ["static-decode", "static-decode int8", "static-decode-eager", "static-decode-eager int8"]
    assert [s["system"] for s in doc["systems"]] == names
    assert [(r["system"], r["context"]) for r in doc["rows"]] == [(n, c) for c in (5, 12) for n in names]
    float_model = load_model(default_model_path())
    float_bytes = sum(p.nbytes for p in float_model.parameters())  # tied head: the embedding, read whole
    int8_bytes = quant.read_bytes(load_model(default_model_path(), quantize="int8"))
    own = {s["system"]: s["weight_bytes"] for s in doc["systems"]}
    assert own == {"static-decode": float_bytes, "static-decode-eager": float_bytes,
                   "static-decode int8": int8_bytes, "static-decode-eager int8": int8_bytes}
    assert int8_bytes < float_bytes / 2
    if hugepages.thp_mode() in ("always", "madvise"):  # each form's weights: the share the kernel put on huge pages
        assert all(0 <= s["weights_on_huge_pages"] <= 1 for s in doc["systems"]), doc["systems"]
    kv = 2 * doc["model"]["layers"] * doc["model"]["kv_heads"] * doc["model"]["head_dim"] * 4
    for b in doc["bound"]:
        assert b["bytes_per_token"] == own[b["system"]] + b["context"] * kv
    for r in doc["rows"]:  # each form's systems give that form's static-decode tokens
        assert r["compared_with"] == ("static-decode int8" if "int8" in r["system"] else "static-decode")
        assert r["tokens_match"] is True, r
    assert doc["relative"]["to"] == "static-decode" and len(doc["relative"]["rows"]) == 8
    assert doc["model"]["quantize"] == ["none", "int8"]
    assert "median over static-decode's" in capsys.readouterr().out


def test_a_bench_beside_llama_cpp_quants_of_tiny_ggufs(tmp_path):
    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llama-cpp-python or gguf not installed (pip install -e '.[test]')")
    spec = importlib.util.spec_from_file_location("sd_profiles_smollm2_forms", ROOT / "profiles" / "smollm2.py")
    smollm2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smollm2)
    f32, q8, q4 = tmp_path / "t-f32.gguf", tmp_path / "t-Q8_0.gguf", tmp_path / "t-Q4_0.gguf"
    weights = tiny_gguf(f32)
    smollm2.quantize_gguf(f32, "Q8_0", q8)
    smollm2.quantize_gguf(f32, "Q4_0", q4)
    norms = 3 * 64 * 4  # 1-D tensors stay float32
    assert bench_lineup.read_gguf(f32) == GGUFFacts("F32", weights * 4 + norms, "llama_model_size (GGUF tensor bytes)")
    assert bench_lineup.read_gguf(q8).tensor_bytes == weights * 34 // 32 + norms  # 32 int8 + an f16 scale a block
    assert bench_lineup.read_gguf(q4).file_type == "Q4_0"
    with pytest.raises(ValueError, match=f"--gguf {tmp_path / 'x.gguf'}: llama.cpp cannot open it"):
        bench_lineup.read_gguf(_files(tmp_path, "x.gguf")[0])

    out = tmp_path / "b.json"
    assert cli.main(["bench", "--quantize", "none,int8", "--gguf", f"{f32},{q8}", "--gguf", f"Q4={q4}",
                     "--systems", "static-decode,llama.cpp", *TINY, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    own = {s["system"]: s["weight_bytes"] for s in doc["systems"]}
    assert list(own) == ["static-decode", "static-decode int8", "llama.cpp F32", "llama.cpp Q8_0", "llama.cpp Q4"]
    assert own["llama.cpp F32"] == weights * 4 + norms and own["llama.cpp Q8_0"] == weights * 34 // 32 + norms
    assert own["llama.cpp Q4"] < own["llama.cpp Q8_0"] < own["llama.cpp F32"]
    assert [s.get("file_type") for s in doc["systems"][2:]] == ["F32", "Q8_0", "Q4_0"]
    # F32 runs on every build; Q8_0/Q4_0 run where the build can (no AMX), and on an AMX build, whose quantized
    # path segfaults on some Xeons, each either runs or is its own crashed row with the rebuild hint
    amx = bench_peer.has_amx(llama_cpp_system_info())
    failed = {s["system"]: s for s in doc["systems"] if "failed" in s}
    assert "llama.cpp F32" not in failed and (amx or not failed), failed
    for name, entry in failed.items():
        assert name in ("llama.cpp Q8_0", "llama.cpp Q4") and entry["failed"].startswith("crashed, SIGSEGV")
        assert "-DGGML_AMX_INT8=OFF" in entry["hint"] and "--no-cache-dir" in entry["hint"]
        assert any(n.startswith(f"{name}: crashed, SIGSEGV") and "rebuild it without AMX" in n for n in doc["notes"])
    ran = set(own) - set(failed)
    assert {r["system"] for r in doc["rows"]} == ran and all(r["ms_per_token"] > 0 for r in doc["rows"])
    assert len(doc["rows"]) == 2 * len(ran)  # both contexts of every system that ran, static-decode's included
    assert all(r["compared_with"] == "static-decode" for r in doc["rows"] if r["system"].startswith("llama.cpp"))
    assert torch.get_num_threads() == 1


def test_transformers_is_skipped_on_a_quantized_checkpoint(tmp_path):
    """transformers reads float weights: on a saved quantized checkpoint the system is skipped with one line."""
    from static_decode.checkpoints.quant_io import save_quantized
    from static_decode.commands.bench.systems import build

    model = quant.quantize_model(load_model(default_model_path()), "int8")
    save_quantized(model, tmp_path / "q", default_model_path())
    system, why = build("transformers", model, path=tmp_path / "q", max_len=64)
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    assert system is None
    assert why == f"skipped: {tmp_path / 'q'} is a quantized checkpoint; transformers reads float weights"


def test_quantize_gguf_runs_static_decode_on_each_file_at_its_bytes(tmp_path):
    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llama-cpp-python or gguf not installed (pip install -e '.[test]')")
    from tests.support import gguf_files
    from tests.support.checkpoints import hf_llama, save

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save(hf_llama(vocab=gguf_files.bpe_tokenizer(ckpt, "smollm").get_vocab_size(), eos=2), ckpt)
    f32 = gguf_files.convert(ckpt, "f32", tmp_path / "t-f32.gguf", pre="smollm")
    q8 = gguf_files.quantize(f32, "Q8_0", tmp_path / "t-Q8_0.gguf")
    with pytest.raises(ValueError, match="--quantize gguf runs static-decode on the --gguf files; none was given"):
        bench_config.BenchConfig(quantize="gguf")
    config = bench_config.BenchConfig(quantize="none,gguf", gguf=f"Q8={q8}")
    assert config.forms == ("none", "gguf:Q8") and config.gguf_forms() == {"gguf:Q8": q8}
    out = tmp_path / "b.json"
    assert cli.main(["bench", "--model", str(ckpt), "--quantize", "none,gguf", "--gguf", f"Q8={q8}",
                     "--systems", "static-decode,llama.cpp", *TINY, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    own = {s["system"]: s["weight_bytes"] for s in doc["systems"]}
    assert list(own) == ["static-decode", "static-decode Q8", "llama.cpp Q8"]
    assert own["static-decode Q8"] == own["llama.cpp Q8"] < own["static-decode"]  # the file's bytes, both systems
    assert {r["system"] for r in doc["rows"]} >= {"static-decode", "static-decode Q8"}
