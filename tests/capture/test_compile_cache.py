"""The persistent compile cache (`CaptureOptions(compile_cache=DIR)`, capture.compile_cache).

Pins:
* two fresh processes with the same DIR, each with its own empty TORCHINDUCTOR_CACHE_DIR: the first misses inductor's
  caches and fills DIR, the second hits them (FX graph and AOTAutograd cache hit counters > 0, no miss), the tokens
  are the same, neither writes a compile into the environment's cache directory, and the environment variable is
  as it was after capture (counters decide, not timings: the seconds are printed only);
* the cache-directory switch restores the environment and inductor's config afterwards (set or unset before);
* per device: the CPU writes no cache artifacts (they do not carry its C++ kernels); on CUDA they are saved to
  DIR/artifacts.bin atomically and loaded once per process (torch's save/load stubbed: no GPU here);
* `CaptureOptions(compile_cache=...)` takes a str or a path and refuses anything else; `capture-report
  --compile-cache DIR --read-len static` reaches the report with that directory and a static read length.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import static_decode.commands.capture_report as report_mod
from capture import CaptureOptions, CaptureReport
from capture import _dynamo_counters as dc
from capture import compile_cache as cc
from static_decode.commands.cli import main
from static_decode.kernels import cpu_kernel

ROOT = Path(__file__).resolve().parents[2]

# One fresh process: the tiny model's greedy first token and decode step (a symbolic read length over two rungs),
# compiled with the given compile cache; prints the cache counters, timings and tokens as JSON.
CHILD = textwrap.dedent(
    """
    import json, logging, os, sys, time
    import torch
    torch.set_num_threads(1)
    logging.getLogger("torch.__trace").propagate = False
    from capture import CaptureOptions
    from capture.compile_cache import cache_counts
    from static_decode import Generator, Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    model = Llama(cfg)
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    opts = CaptureOptions(buckets=(16, 32), kinds=("first_greedy", "decode_greedy"), progress=False,
                          compile_cache=sys.argv[1])
    t0 = time.perf_counter()
    gen = Generator(model, max_len=32, chunk_size=8, batch=1, compile=True, eos_token_ids=[], capture=opts)
    seconds = time.perf_counter() - t0
    print(json.dumps({
        "counts": cache_counts(), "seconds": seconds, "env_kept": os.environ.get("TORCHINDUCTOR_CACHE_DIR") == env,
        "graphs": sum(r.graphs + r.region_graphs for r in gen.capture_records),
        "fused": gen.runner.regions.fused is not None,
        "tokens": gen.generate([[5, 9, 2]], 20, stop_at_eos=False),
    }))
    """
)


def _child(directory: Path, env_cache: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(env_cache), PYTHONPATH=str(ROOT))
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    run = subprocess.run([sys.executable, "-c", CHILD, str(directory)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _compiled_files(directory: Path) -> list[Path]:
    """What inductor writes for a compile: FX graph and AOTAutograd cache entries, generated code, libraries."""
    return [p for p in directory.rglob("*") if p.is_file() and p.suffix in ("", ".so", ".py", ".cpp")
            and "locks" not in p.parts]


def test_a_new_process_with_the_same_directory_skips_inductor(tmp_path: Path) -> None:
    directory = tmp_path / "compile-cache"
    first = _child(directory, tmp_path / "env1")
    second = _child(directory, tmp_path / "env2")
    print(f"\ncompile cache: first process {first['seconds']:.1f} s, second {second['seconds']:.1f} s")
    assert first["counts"]["fxgraph_miss"] > 0 and first["counts"]["fxgraph_hit"] == 0
    assert second["counts"]["fxgraph_hit"] > 0 and second["counts"]["fxgraph_miss"] == 0
    assert second["counts"]["autograd_hit"] > 0 and second["counts"]["autograd_miss"] == 0
    # first_greedy, decode_greedy once for both rungs, and the one-token layer region (capture.regions) unless the
    # fused decode layers run one-token steps: they do where this CPU's kernel takes the model's head_dim 8 (the
    # 8-float vectors of AVX2 and the portable build), not on AVX-512 (16 floats a vector)
    fused = cpu_kernel.available() and cpu_kernel.supports(2, 8, torch.float32, torch.device("cpu"))
    assert first["fused"] == second["fused"] == fused
    assert first["graphs"] == second["graphs"] == (2 if fused else 3)
    assert first["tokens"] == second["tokens"]
    assert first["env_kept"] and second["env_kept"]
    assert (directory / "inductor" / "fxgraph").is_dir() and not (directory / cc.ARTIFACTS).exists()  # CPU
    for env_cache in (tmp_path / "env1", tmp_path / "env2"):  # DIR was used in preference to the environment's
        assert _compiled_files(env_cache) == [], _compiled_files(env_cache)


@pytest.mark.parametrize("before", [None, "/somewhere/else"])
def test_the_directory_switch_restores_environment_and_config(tmp_path: Path, monkeypatch, before) -> None:
    import torch._inductor.config as inductor_config

    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        if before is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, before)
    with inductor_config.patch(fx_graph_cache=False):  # (a config module, not monkeypatched: setattr undo hides it)
        with dc.inductor_cache_dir(tmp_path / "inductor", tmp_path / "triton"):
            assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "inductor").resolve())
            assert os.environ["TRITON_CACHE_DIR"] == str((tmp_path / "triton").resolve())
            assert inductor_config.fx_graph_cache  # a named directory is meant to be filled
        assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before and os.environ.get("TRITON_CACHE_DIR") == before
        assert inductor_config.fx_graph_cache is False
    with dc.inductor_cache_dir(tmp_path / "inductor"):  # no Triton directory (the CPU): TRITON_CACHE_DIR untouched
        assert os.environ.get("TRITON_CACHE_DIR") == before


def test_artifacts_are_saved_and_loaded_on_cuda_only(tmp_path: Path, monkeypatch) -> None:
    loaded: list[bytes] = []
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"kernels", object()))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loaded.append(data))
    monkeypatch.setattr(cc, "_LOADED", set())
    cpu = cc.CompileCache(tmp_path / "cpu", "cpu")
    assert not cpu.save() and not cpu.load() and not (tmp_path / "cpu").exists()
    assert cpu.triton_dir is None
    cuda = cc.CompileCache(tmp_path / "cuda", torch.device("cuda"))  # a device object only: no GPU is touched
    assert not cuda.load()  # nothing saved yet
    assert cuda.save() and (tmp_path / "cuda" / cc.ARTIFACTS).read_bytes() == b"kernels"
    assert not list((tmp_path / "cuda").glob("*.tmp"))  # written through a temporary file, then renamed
    monkeypatch.setattr(cc, "_LOADED", set())  # a new process
    again = cc.CompileCache(tmp_path / "cuda", "cuda")
    assert again.load() and loaded == [b"kernels"]
    assert not again.load() and loaded == [b"kernels"]  # once per process
    assert again.triton_dir == tmp_path / "cuda" / "triton"


def test_capture_options_take_a_path(tmp_path: Path) -> None:
    assert CaptureOptions(compile_cache=str(tmp_path)).compile_cache == tmp_path
    assert CaptureOptions(compile_cache=tmp_path).compile_cache == tmp_path
    assert CaptureOptions().compile_cache is None
    for bad in (3, "", ["dir"]):
        with pytest.raises(TypeError, match="compile_cache must be a directory path"):
            CaptureOptions(compile_cache=bad)


def test_capture_report_passes_the_compile_cache_and_read_length(tmp_path: Path, monkeypatch) -> None:
    seen = {}

    def fake(model, **kw):
        seen.update(kw)
        return CaptureReport(records=[], seconds=0.0)

    monkeypatch.setattr(report_mod, "build_report", fake)
    args = ["capture-report", "--max-len", "64", "--kinds", "first_greedy", "--device", "cpu", "--quiet",
            "--compile-cache", str(tmp_path), "--read-len", "static"]
    assert main(args) == 0
    assert seen["compile_cache"] == tmp_path and seen["settings"].symbolic_read_len is False
    assert main(args[:-2]) == 0 and seen["settings"] is None  # no --read-len: the runner's device default
