"""The tiny model and its eager generator that the compiled-step tests compare against (tests/support/compiled_cases.py
has the cases); a module that defines its own `model` fixture keeps it."""

from __future__ import annotations

import pytest
import torch

from static_decode import Generator, Llama
from tests.support.compiled_cases import CFG, CHUNK, MAX_LEN


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG)


@pytest.fixture(scope="module")
def eager(model: Llama) -> Generator:
    return Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[])
