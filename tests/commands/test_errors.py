"""Failures the CLI meets outside the user's arguments: each is one line on stderr and exit status 2, never a
traceback. A truncated or corrupt checkpoint or tokenizer.json, a device this machine lacks, an allocation that
runs out of memory, and a cache too large for the device (refused in GiB before it is allocated)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from static_decode.checkpoints.loading import SINGLE_FILE, load_model, load_tokenizer
from static_decode.commands import cli
from static_decode.generation import memory
from static_decode.model.llama import Llama
from tests.support.checkpoints import hf_llama, save

ARGS = ("--prompt-ids", "3,1,4", "--max-new-tokens", "2")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return save(hf_llama(seed=43, eos=None), tmp_path_factory.mktemp("good"))


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A copy of the good checkpoint that a test may damage."""
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def run(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    return rc, capsys.readouterr().err


def assert_one_line(err: str, command: str = "generate") -> None:
    assert err.startswith(f"static-decode {command}: error: "), err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err


def truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.001, 0.0])
def test_a_truncated_safetensors_file_is_one_line(ckpt, capsys, keep):
    truncate(ckpt / SINGLE_FILE, keep)
    rc, err = run(capsys, "generate", "--model", str(ckpt), *ARGS, "--device", "cpu")
    assert rc == 2
    assert_one_line(err)
    assert str(ckpt / SINGLE_FILE) in err and "truncated or corrupt" in err


def test_a_truncated_shard_names_the_shard(tmp_path):
    path = save(hf_llama(seed=44, eos=None), tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1
    truncate(shards[-1])
    with pytest.raises(ValueError, match=rf"{shards[-1]} is truncated or corrupt: Error while deserializing header"):
        load_model(path)


def test_a_safetensors_file_of_garbage_is_refused(ckpt):
    (ckpt / SINGLE_FILE).write_bytes(b"this is not a safetensors file" * 10)
    with pytest.raises(ValueError, match=f"{ckpt / SINGLE_FILE} is truncated or corrupt"):
        load_model(ckpt)


def test_a_missing_weights_file_keeps_its_error(ckpt):
    (ckpt / SINGLE_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_model(ckpt)


@pytest.mark.parametrize("text", ["{not json", "", '{"model": 3}'])
def test_a_corrupt_tokenizer_json_is_one_line(ckpt, capsys, text):
    (ckpt / "tokenizer.json").write_text(text)
    with pytest.raises(ValueError, match=f"{ckpt / 'tokenizer.json'} is not a valid tokenizer file: "):
        load_tokenizer(ckpt)
    rc, err = run(capsys, "generate", "--model", str(ckpt), "--prompt", "hi", "--device", "cpu")
    assert rc == 2
    assert_one_line(err)
    assert "tokenizer.json is not a valid tokenizer file" in err


def _absent_devices() -> list[str]:
    out = ["foo", "cuda:x", "meta"]
    if torch.cuda.device_count() <= 7:
        out.append("cuda:7")
    if not torch.cuda.is_available():
        out.append("cuda")
    return out


@pytest.mark.parametrize("device", _absent_devices())
def test_a_device_this_machine_lacks_is_one_line(saved, capsys, device):
    rc, err = run(capsys, "generate", "--model", str(saved), *ARGS, "--device", device)
    assert rc == 2
    assert_one_line(err)
    assert f"--device {device}" in err or f"--device {device!r}" in err
    if device in ("cuda", "cuda:7"):
        assert f"this machine has {torch.cuda.device_count()} CUDA device" in err


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="this machine has a cuda:7")
@pytest.mark.parametrize("command", ["capture-report", "bench"])
def test_every_command_checks_the_device(saved, capsys, command):
    threads = torch.get_num_threads()  # bench sets the thread count before it looks at the device
    try:
        rc, err = run(capsys, command, "--model", str(saved), "--device", "cuda:7")
    finally:
        torch.set_num_threads(threads)
    assert rc == 2
    assert_one_line(err, command)
    assert "cuda:7" in err and "CUDA device" in err


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory:\n"
                     "you tried to allocate 10000000000000 bytes."),
    ],
)
def test_out_of_memory_at_allocation_is_one_line(saved, capsys, monkeypatch, error):
    def refuse(self, batch, max_len):
        raise error

    monkeypatch.setattr(Llama, "new_cache", refuse)
    rc, err = run(capsys, "generate", "--model", str(saved), *ARGS, "--device", "cpu")
    assert rc == 2
    assert_one_line(err)
    assert "error: out of memory: " in err and "--max-len" in err


def test_another_runtime_error_keeps_its_traceback(saved, monkeypatch):
    def broken(self, batch, max_len):
        raise RuntimeError("a bug, not a user error")

    monkeypatch.setattr(Llama, "new_cache", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["generate", "--model", str(saved), *ARGS, "--device", "cpu"])


def test_a_cache_too_large_for_the_device_is_refused_in_gib(saved, capsys, monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda device: 2 * memory.GIB)
    rc, err = run(capsys, "generate", "--model", str(saved), *ARGS, "--max-len", str(10**12), "--device", "cpu")
    assert rc == 2
    assert_one_line(err)
    assert "the KV cache and step buffers need " in err and "GiB on cpu, which has 2.00 GiB free" in err
