"""The checkpoints the command-line tests run (a plain one without a tokenizer, a byte-level one with
tokenizer.json); tests/support/cli.py has `run`."""

from __future__ import annotations

import pytest

from tests.support.checkpoints import byte_tokenizer, hf_llama, save


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
