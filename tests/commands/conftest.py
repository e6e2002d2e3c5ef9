"""The checkpoints the command-line tests run (a plain one without a tokenizer, a byte-level one with
tokenizer.json), the embedded model with a chat template for the servers; tests/support/cli.py has `run`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from static_decode.checkpoints.loading import default_model_path
from tests.support.checkpoints import byte_tokenizer, hf_llama, save
from tests.support.servers import TEMPLATE


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A checkpoint without a tokenizer."""
    return save(hf_llama(seed=41, eos=None), tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def texty(tmp_path_factory):
    """A byte-level checkpoint (vocab 256) with tokenizer.json."""
    path = save(hf_llama(seed=42, vocab=256, eos=None), tmp_path_factory.mktemp("texty"))
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """The embedded model with a chat template (it has none of its own)."""
    d = tmp_path_factory.mktemp("served")
    for f in default_model_path().iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    return d
