"""The bench survives its peers: each llama.cpp system runs in a worker process, and a worker that really
crashes (a segfault), hangs, exits or raises becomes that system's row while every other system is reported.

The misbehaving peers are real subprocesses: the worker (static_decode.commands.bench.llama_cpp_worker) imports a
`llama_cpp` written here onto the worker's PYTHONPATH whose eval dereferences NULL (SIGSEGV), sleeps forever,
or exits; the bench itself (its GGUF facts) uses the installed llama-cpp-python on a real tiny GGUF.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

from static_decode.commands import cli
from static_decode.commands.bench import peer as bench_peer
from static_decode.commands.bench.peer import PeerFailed, PeerProcess
from tests.support.checkpoints import tiny_gguf

TINY = ["--contexts", "5,12", "--max-len", "24", "--steps", "2", "--repeats", "2", "--warmup", "1",
        "--compile-backend", "eager", "--no-attention", "--threads", "1", "--quiet", "--no-transformers-compile"]
AMX_LINE = "CPU : AVX512 = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | OPENMP = 1 | "
PLAIN_LINE = "CPU : AVX512 = 1 | AVX512_BF16 = 1 | OPENMP = 1 | "

# A stand-in llama_cpp for the worker: FAKE_PEER says how it misbehaves, FAKE_PEER_AT on which eval call.
FAKE = '''
import ctypes, os, sys, time
__version__ = "fake"
MODE, AT = os.environ.get("FAKE_PEER", "ok"), int(os.environ.get("FAKE_PEER_AT", "0"))
VOCAB = 256
_row = (ctypes.c_float * VOCAB)()

def llama_print_system_info():
    return os.environ.get("FAKE_PEER_INFO", "CPU : AVX2 = 1 | ").encode()

def llama_get_logits_ith(ctx, i):
    return _row

class Llama:
    def __init__(self, model_path, n_ctx, **kw):
        if MODE == "load":
            raise ValueError(f"cannot read {model_path}")
        self._n_ctx, self.n_batch, self.ctx, self.metadata, self.calls = n_ctx, 512, None, {"general.file_type": "7"}, 0
    def n_vocab(self): return VOCAB
    def n_ctx(self): return self._n_ctx
    def reset(self): pass
    def eval(self, tokens):
        self.calls += 1
        if self.calls > AT:
            if MODE == "crash":
                ctypes.string_at(0)  # a real segfault in native code
            if MODE == "hang":
                time.sleep(3600)
            if MODE == "exit":
                os._exit(3)
        for i in range(VOCAB):
            _row[i] = 1.0 if i == (tokens[-1] + 1) % VOCAB else 0.0
'''


@pytest.fixture
def fake_peer(tmp_path, monkeypatch):
    """Point the worker processes at the stand-in llama_cpp; returns a setter for its mode."""
    (tmp_path / "fake" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "fake" / "llama_cpp" / "__init__.py").write_text(FAKE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))

    def mode(how: str, at: int = 0, info: str = PLAIN_LINE) -> None:
        monkeypatch.setenv("FAKE_PEER", how)
        monkeypatch.setenv("FAKE_PEER_AT", str(at))
        monkeypatch.setenv("FAKE_PEER_INFO", info)

    return mode


@pytest.fixture
def gguf(tmp_path):
    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llama-cpp-python or gguf not installed (pip install -e '.[test]')")
    tiny_gguf(tmp_path / "t.gguf")
    return tmp_path / "t.gguf"


def _bench(tmp_path: Path, gguf: Path, *extra: str) -> dict:
    out = tmp_path / "b.json"
    assert cli.main(["bench", "--gguf", f"Q8_0={gguf}", "--systems", "static-decode,static-decode-eager,llama.cpp",
                     *TINY, *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _own_rows_all_there(doc: dict) -> None:
    own = {(r["system"], r["context"]) for r in doc["rows"] if r["system"].startswith("static-decode")}
    assert own == {(s, c) for s in ("static-decode", "static-decode-eager") for c in (5, 12)}
    assert all(r["tokens_match"] is True and r["repeats"] == 2 for r in doc["rows"])
    assert {b["system"] for b in doc["bound"]} == {"static-decode", "static-decode-eager"}


def test_a_peer_that_segfaults_mid_run_is_its_own_crashed_row(tmp_path, gguf, fake_peer, capsys):
    fake_peer("crash", at=9, info=AMX_LINE)  # 3 evals a request: the warm-up and one timed request run
    doc = _bench(tmp_path, gguf)
    entry = next(s for s in doc["systems"] if s["system"] == "llama.cpp Q8_0")
    assert entry["failed"].startswith("crashed, SIGSEGV (context ") and entry["failed"].endswith(", timed)")
    assert "Fatal Python error: Segmentation fault" in entry["stderr_tail"]  # the worker's own stderr, kept
    assert "-DGGML_AMX_INT8=OFF" in entry["hint"] and "--no-cache-dir" in entry["hint"]
    assert entry["weight_bytes"] > 0 and "in a worker process (its build uses AMX)" in entry["mode"]
    assert not [r for r in doc["rows"] if r["system"] == "llama.cpp Q8_0"]  # no half-timed row
    _own_rows_all_there(doc)
    note = next(n for n in doc["notes"] if n.startswith("llama.cpp Q8_0: "))
    assert note.startswith("llama.cpp Q8_0: crashed, SIGSEGV") and "rebuild it without AMX" in note
    out = capsys.readouterr().out
    assert "crashed, SIGSEGV" in out and "FAILED: crashed, SIGSEGV" in out


def test_a_crash_without_amx_has_no_rebuild_hint(tmp_path, gguf, fake_peer):
    fake_peer("crash", at=0)  # the first eval: the warm-up
    doc = _bench(tmp_path, gguf)
    entry = next(s for s in doc["systems"] if s["system"] == "llama.cpp Q8_0")
    assert entry["failed"] == "crashed, SIGSEGV (context 5, warm-up)" and "hint" not in entry
    _own_rows_all_there(doc)


def test_a_peer_that_hangs_is_killed_at_its_bound(tmp_path, gguf, fake_peer):
    fake_peer("hang", at=4)  # the second warm-up request
    t0 = time.monotonic()
    doc = _bench(tmp_path, gguf, "--peer-timeout", "3")
    assert time.monotonic() - t0 < 120
    entry = next(s for s in doc["systems"] if s["system"] == "llama.cpp Q8_0")
    assert entry["failed"] == "hung: no answer within 3 s (killed) (context 12, warm-up)"
    _own_rows_all_there(doc)
    assert "--peer-timeout 3" in doc["bench"]["command"]


@pytest.mark.parametrize(("how", "failed"), [("load", "failed: ValueError: cannot read "),
                                              ("exit", "exited with status 3 (context 5, warm-up)")])
def test_a_peer_that_fails_to_load_or_exits_is_its_own_row(tmp_path, gguf, fake_peer, how, failed):
    fake_peer(how)
    doc = _bench(tmp_path, gguf)
    entry = next(s for s in doc["systems"] if s["system"] == "llama.cpp Q8_0")
    assert entry["failed"].startswith(failed), entry
    assert "mode" not in entry or how != "load"
    _own_rows_all_there(doc)


def test_a_working_peer_process_answers_and_ends(tmp_path, gguf, fake_peer):
    """The worker's protocol on the stand-in: greedy tokens follow its logits; close ends the process."""
    fake_peer("ok")
    from static_decode.commands.bench.systems import LlamaCppSystem

    s = LlamaCppSystem(gguf, max_len=24, threads=1, timeout_s=60)
    s.start([7, 9], 4)
    assert s.finish() == [10, 11, 12, 13]  # each token is the previous + 1 (the stand-in's one-hot logits)
    s.start([200], 2)
    assert s.finish() == [201, 202]
    pid = s.peer.proc.pid
    s.close()
    assert s.peer.proc.returncode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_peer_process_refusals_and_unknown_requests(fake_peer):
    fake_peer("ok")
    with pytest.raises(ValueError, match=r"peer timeout must be > 0 s, got 0"):
        PeerProcess("static_decode.commands.bench.llama_cpp_worker", 0)
    p = PeerProcess("static_decode.commands.bench.llama_cpp_worker", 60)
    with pytest.raises(PeerFailed, match=r"failed: RuntimeError: 'start' before 'load'"):
        p.call({"op": "start", "prompt": [1], "new_tokens": 1})
    with pytest.raises(PeerFailed, match=r"failed: RuntimeError"):  # a failed peer stays failed
        p.call({"op": "info"})
    assert p.proc.poll() is not None


def test_amx_is_read_from_llama_cpp_system_line():
    assert bench_peer.has_amx(AMX_LINE) and not bench_peer.has_amx(PLAIN_LINE)
    assert bench_peer.amx_hint(PLAIN_LINE) == ""
    assert "GGML_NATIVE=OFF" in bench_peer.amx_hint(AMX_LINE)
