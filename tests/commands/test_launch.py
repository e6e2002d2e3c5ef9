"""`torchrun --nproc-per-node N -m static_decode generate ...`: the CLI under a distributed launch.

Pins: two gloo ranks print exactly what the single process prints, once (rank 0 only; the others are silent),
and the summary names the tensor-parallel group; capture-report compiles each rank's steps and rank 0 writes
one report saying so; bench runs the tensor-parallel systems and skips the rest with a note; a world size that
does not divide the KV heads fails on every rank with the reason and the rank; torchrun's variables are read
strictly (absent or WORLD_SIZE=1: a single process, nothing distributed starts); a rank asking for a GPU the
machine lacks is refused naming the count; a command that cannot run sharded refuses to start under torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from static_decode.commands import cli, launch
from tests.support.checkpoints import hf_llama, save

PROMPT = "5,17,33,2,90,61,7"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save(hf_llama(seed=11), tmp_path_factory.mktemp("launch"))  # 8 query / 2 KV heads


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in launch.ENV_VARS}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _generate(ckpt, *prefix: str) -> subprocess.CompletedProcess:
    args = ["generate", "--model", str(ckpt), "--prompt-ids", PROMPT, "--max-new-tokens", "12", "--device", "cpu"]
    return subprocess.run([sys.executable, *prefix, "-m", "static_decode", *args], env=_env(), capture_output=True,
                          text=True, timeout=240)


def _torchrun(n: int) -> tuple[str, ...]:
    return ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n))


def test_two_ranks_print_what_one_process_prints(ckpt):
    single = _generate(ckpt)
    assert single.returncode == 0, single.stderr
    assert single.stdout.startswith(f"prompt ids: {PROMPT}\nnew ids: ")
    sharded = _generate(ckpt, *_torchrun(2))
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert sharded.stdout == single.stdout  # same tokens, printed once
    assert sharded.stderr.count("ms per decoded token") == 1
    assert "[tensor-parallel rank 0 of 2, gloo]" in sharded.stderr


def test_capture_report_on_two_ranks(ckpt, tmp_path):
    """Each rank compiles its shard's steps; rank 0 writes the report, marked tensor-parallel. (first_greedy only:
    the plumbing is under test here; inductor graphs with the all-reduces inside are test_parallel's.)"""
    out = tmp_path / "report.json"
    args = ["capture-report", "--model", str(ckpt), "--max-len", "16", "--chunk-size", "8", "--device", "cpu",
            "--kinds", "first_greedy", "--quiet", "--json", str(out)]
    run = subprocess.run([sys.executable, *_torchrun(2), "-m", "static_decode", *args], env=_env(),
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["tensor_parallel"] == {"world": 2, "backend": "gloo"}
    assert [(r["kind"], r["read_len"], r["graphs"], r["graph_breaks"], r["fallback"]) for r in report["records"]] == [
        ("first_greedy", 0, 1, 0, "")
    ]
    assert run.stdout.count("capture:") == 1  # one table: rank 0's


def test_bench_on_two_ranks(ckpt, tmp_path):
    """The tensor-parallel systems run on every rank (dynamo-only compile to keep it short), the single-process
    baselines and the attention rows are skipped with a note, rank 0 writes the JSON, tokens match."""
    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(ckpt), "--contexts", "6", "--max-len", "32", "--steps", "4", "--repeats", "1",
            "--compile-backend", "eager", "--attention-lengths", "64", "--quiet", "--json", str(out)]
    run = subprocess.run([sys.executable, *_torchrun(2), "-m", "static_decode", *args], env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["machine"]["tensor_parallel"] == {"world": 2, "backend": "gloo"}
    assert doc["bench"]["command"].startswith("torchrun --nproc-per-node 2 -m static_decode bench")
    assert [r["system"] for r in doc["rows"]] == ["static-decode", "static-decode-eager", "full-read"]
    assert all(r["tokens_match"] is True for r in doc["rows"])
    skipped = {s["system"]: s.get("skipped", "") for s in doc["systems"]}
    assert all("not tensor-parallel" in skipped[name] for name in ("concat", "transformers"))
    assert doc["attention"] == [] and any("attention: skipped under tensor parallelism" in n for n in doc["notes"])


def test_world_size_not_dividing_kv_heads_fails_on_every_rank(ckpt):
    run = _generate(ckpt, *_torchrun(3))
    assert run.returncode != 0 and run.stdout == ""
    why = "error: tensor-parallel world size 3 does not divide num_kv_heads=2"
    for rank in range(3):
        assert f"static-decode generate [rank {rank}]: {why}" in run.stderr


def test_distributed_env_is_read_strictly():
    assert launch.distributed_env({}) is None
    assert launch.distributed_env({"WORLD_SIZE": "1", "RANK": "0"}) is None
    assert launch.distributed_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}) == (3, 4, 1)
    with pytest.raises(ValueError, match="must be ints"):
        launch.distributed_env({"WORLD_SIZE": "two"})
    with pytest.raises(ValueError, match="RANK=4, LOCAL_RANK=0 do not fit WORLD_SIZE=4"):
        launch.distributed_env({"WORLD_SIZE": "4", "RANK": "4", "LOCAL_RANK": "0"})


def test_pick_device():
    assert launch.pick_device("cpu", 1) == torch.device("cpu")
    if torch.cuda.device_count() < 8:
        with pytest.raises(ValueError, match="LOCAL_RANK=7 needs cuda:7, this machine has"):
            launch.pick_device("cuda", 7)
    with pytest.raises(ValueError, match="'foo' is not a torch device"):  # one line, not torch's parser error
        launch.pick_device("foo", 0)


def test_single_process_launch_touches_nothing_distributed(monkeypatch):
    for name in launch.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    with launch.session("cpu") as where:
        assert not where.tp.enabled and where.backend is None and where.is_main
    assert not torch.distributed.is_initialized()


def test_a_command_that_cannot_shard_refuses_under_torchrun(monkeypatch, capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("local").set_defaults(run=lambda args: 0)  # no distributed=True
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["local"]) == 2
    assert "does not run under torchrun (WORLD_SIZE=2)" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


# One process by design: the server owns one port and one request queue; perplexity scores one text; quantize
# writes one checkpoint (a tensor-parallel load slices it later).
SINGLE_PROCESS = {"serve", "perplexity", "quantize"}


def test_every_shipped_command_runs_under_torchrun():
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) >= SINGLE_PROCESS
    assert {name for name, p in commands.items() if p.get_default("distributed")} == set(commands) - SINGLE_PROCESS


def test_chat_on_two_ranks_prints_what_one_process_prints(tmp_path):
    """Rank 0 reads stdin and shares each line; every rank takes the same turns over its shard."""
    from tests.support.checkpoints import byte_tokenizer

    path = save(hf_llama(seed=8, vocab=128, eos=None), tmp_path)  # 8 query / 2 KV heads
    byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    args = ["chat", "--model", str(path), "--max-new-tokens", "6", "--max-len", "96", "--device", "cpu"]

    def chat(*prefix: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *prefix, "-m", "static_decode", *args], env=_env(), input="hi\nagain\n",
                              capture_output=True, text=True, timeout=240)

    single, sharded = chat(), chat(*_torchrun(2))
    assert single.returncode == 0, single.stderr[-2000:]
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert sharded.stdout == single.stdout and single.stdout.count("\n") >= 2
    assert sharded.stderr.count("[turn 2: prefilled") == 1  # rank 0 prints


_TEARDOWN = """
import os, sys, torch
from static_decode.commands import launch

def gloo_threads():
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:
            pass
    return sorted(n for n in names if "gloo" in n)

with launch.session("cpu") as run:
    import torch._dynamo  # as every compiled step does, after the group exists
    total = run.tp.all_reduce(torch.full((4,), float(run.tp.rank + 1)))
    with torch.inference_mode():
        total = run.tp.all_reduce(total)
    line = run.tp.from_rank0("hi" if run.tp.rank == 0 else None)
    during = gloo_threads()
with open(os.path.join(sys.argv[1], f"rank{run.tp.rank}.txt"), "w") as f:
    f.write(f"{total.tolist()} {line} {during != []} {gloo_threads()}")
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc (Linux)")
def test_leaving_a_session_stops_the_collectives_threads(tmp_path):
    """The process group dies with the session: no gloo thread lives on into the interpreter's teardown, where one
    still releasing a collective's tensor would take the GIL and abort the process (a rank 'terminate called
    without an active exception' at exit, seen in CI). funcol's eager AsyncCollectiveTensor kept it alive."""
    script = tmp_path / "teardown.py"
    script.write_text(_TEARDOWN)
    env = _env() | {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), *sys.path])}
    r = subprocess.run([sys.executable, *_torchrun(2), str(script), str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):  # (1 + 2) summed, then summed again; the line rank 0 shared; threads during, none after
        assert (tmp_path / f"rank{rank}.txt").read_text() == "[6.0, 6.0, 6.0, 6.0] hi True []"
