"""Hub ids as --model, resolved offline in a Hub cache laid out here the way huggingface_hub lays it out
(models--org--name/blobs, snapshots/<commit>/ links into them, refs/main), checked by huggingface_hub's own
`scan_cache_dir`. No network: HF_HUB_OFFLINE is set and the resolver only reads the cache.

Reference: the same checkpoint loaded from its directory.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from static_decode.checkpoints.hub import is_hub_id, resolve_hub
from static_decode.checkpoints.loading import load_model, load_tokenizer
from static_decode.commands import cli
from tests.support.checkpoints import byte_tokenizer, feed, hf_llama, save

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_repo(cache: Path, repo: str, files: dict[str, bytes], commit: str = COMMIT) -> Path:
    """Write `files` into `cache` as huggingface_hub stores a downloaded snapshot; return the snapshot folder."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(the Hub cache folder, the checkpoint directory cached in it as org/tiny)."""
    from huggingface_hub import constants, scan_cache_dir

    ckpt = save(hf_llama(vocab=256, seed=4), tmp_path / "ckpt")
    byte_tokenizer().save(str(ckpt / "tokenizer.json"))
    cache = tmp_path / "hub"
    _cache_repo(cache, "org/tiny", {p.name: p.read_bytes() for p in ckpt.iterdir()})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    info = scan_cache_dir(cache)  # huggingface_hub reads the layout as its own
    assert [(r.repo_id, [v.commit_hash for v in r.revisions]) for r in info.repos] == [("org/tiny", [COMMIT])]
    return cache, ckpt


def test_a_hub_id_loads_the_cached_snapshot(hub):
    cache, ckpt = hub
    for spec in ("org/tiny", "org/tiny@main", f"org/tiny@{COMMIT}"):
        assert resolve_hub(spec) == cache / "models--org--tiny" / "snapshots" / COMMIT
    got, ref = load_model("org/tiny"), load_model(ckpt)
    assert got.config == ref.config
    torch.testing.assert_close(feed(got, [[3, 1, 4, 1, 5]], 2)[0], feed(ref, [[3, 1, 4, 1, 5]], 2)[0], rtol=0, atol=0)
    assert load_tokenizer("org/tiny").encode("hi there").ids == list(b"hi there")


def test_a_missing_id_fails_in_one_line_naming_it(hub, capsys):
    with pytest.raises(FileNotFoundError) as e:
        load_model("org/absent")
    assert "\n" not in str(e.value)
    assert "Hub model 'org/absent' is not in the local Hugging Face cache" in str(e.value)
    assert "hf download org/absent" in str(e.value)
    with pytest.raises(FileNotFoundError, match="hf download org/tiny --revision v9"):
        load_model("org/tiny@v9")
    assert cli.main(["generate", "--model", "org/absent", "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "'org/absent' is not in the local Hugging Face cache" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_generate_takes_a_hub_id(hub, capsys):
    _, ckpt = hub
    argv = ["generate", "--prompt", "Hello", "--max-new-tokens", "5"]
    assert cli.main([*argv, "--model", str(ckpt)]) == 0
    want = capsys.readouterr().out
    assert cli.main([*argv, "--model", "org/tiny"]) == 0
    assert capsys.readouterr().out == want


def test_a_gguf_repo_resolves_to_its_one_file(hub, tmp_path):
    from tests.support.checkpoints import tiny_gguf

    cache, _ = hub
    tiny_gguf(tmp_path / "x.gguf")
    snap = _cache_repo(cache, "org/tiny-GGUF", {"model-f32.gguf": (tmp_path / "x.gguf").read_bytes()})
    assert resolve_hub("org/tiny-GGUF") == snap / "model-f32.gguf"
    _cache_repo(cache, "org/two-GGUF", {"a.gguf": b"GGUF", "b.gguf": b"GGUF"})
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\); pass one by its path"):
        resolve_hub("org/two-GGUF")


def test_what_reads_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("org/name") and is_hub_id("org/name@v1.0")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # a local directory wins
    for text in ("name", "a/b/c", "/abs/path", "./org/x", "org/x.gguf", "org/bad name"):
        assert not is_hub_id(text), text
