"""Two tiny checkpoints written by transformers, loaded as the target and the draft model of the speculative
decoding tests."""

from __future__ import annotations

import pytest

from static_decode import load_model
from tests.support.checkpoints import hf_llama, save


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    return load_model(save(hf_llama(seed=31), d / "target")), load_model(save(hf_llama(seed=32), d / "draft"))
