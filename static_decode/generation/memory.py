"""What a Generator's static allocation costs, and a refusal before allocating a size the device cannot hold.

A KV cache is sized by max_len, and a large --max-len asks for tens of GiB at once. Allocating first and
failing later gives an allocator traceback (or, on a CPU host, the OOM killer); checking the byte count against
the device's free memory first gives one sentence in GiB and leaves the caller's state untouched.

`generation_bytes` is exact, not an estimate: it mirrors the shapes of `StaticKVCache` (core/cache.py) and counts
the step buffers from the table they are allocated from (steps/functions.py's `buffer_layout`), and
tests/generation/test_memory.py pins it to the `.nbytes` of a real allocation. Memory the steps need while they run
(activations, logits, compiled graphs) is not counted: it depends on the runner, and is small next to the cache.
"""

from __future__ import annotations

import math

import torch

from static_decode.base.checks import check_int
from static_decode.base.free_memory import GIB, free_bytes, gib  # noqa: F401 - re-exported
from static_decode.core import kv_quant
from static_decode.core.cache import SPARE_ROWS
from static_decode.model.config import LlamaConfig
from static_decode.model.quant import read_bytes as quant_read_bytes
from static_decode.model.quant import weight_bytes as quant_weight_bytes
from static_decode.steps.functions import buffer_layout

INT64 = 8  # bytes of the cache's int64 lengths


def cache_bytes(
    config: LlamaConfig, batch: int, max_len: int, dtype: torch.dtype, *, kv_heads: int | None = None
) -> int:
    """Bytes of a StaticKVCache: K and V ([layers, B, Hkv, max_len + spare, d] each) plus the int64 lengths; an int8
    cache's float32 scales beside them ([layers, B, Hkv, max_len + spare] each; core/kv_quant.py).

    kv_heads defaults to the config's; a tensor-parallel rank passes its share (`Llama.kv_heads`).
    """
    heads = config.num_kv_heads if kv_heads is None else check_int("kv_heads", kv_heads, minimum=1)
    rows = config.num_layers * batch * heads * (max_len + SPARE_ROWS)  # token rows of K (and of V)
    scales = 2 * rows * kv_quant.SCALE_BYTES if kv_quant.is_int8(_dtype(dtype)) else 0
    return 2 * rows * config.head_dim * _itemsize(dtype) + scales + batch * INT64


def layout_bytes(layout: dict[str, tuple[tuple[int, ...], torch.dtype, float]]) -> int:
    """Bytes of the step buffers of `layout` (steps.functions.buffer_layout: what StepBuffers.allocate makes)."""
    return sum(math.prod(shape) * _itemsize(dt) for shape, dt, _ in layout.values())


def generation_bytes(
    config: LlamaConfig,
    batch: int,
    max_len: int,
    chunk_size: int,
    eos_slots: int,
    dtype: torch.dtype,
    *,
    kv_heads: int | None = None,
    draft_tokens: int = 0,
    draft_vocab: int = 0,
    long_chunk: int = 0,
    kv_dtype: torch.dtype | None = None,
    logprobs: int | None = None,
    grammar: tuple[int, int] | None = None,
) -> int:
    """Device bytes a Generator allocates for `batch` rows of `max_len` tokens: the KV cache (with its one spare
    position; in `kv_dtype`, default `dtype`) plus the step buffers, whose output holds max_len tokens per row (a
    draft model's own cache is `cache_bytes` of its config, added by the caller; `seen` spans the config's
    vocabulary; `logprobs`: the top logprobs kept per token, None: none; `grammar`: the (states, token classes) of the
    grammar tables, None: none). Python ints: no overflow however large max_len is."""
    batch = check_int("batch", batch, minimum=0)
    max_len = check_int("max_len", max_len, minimum=1)
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    eos_slots = check_int("eos_slots", eos_slots, minimum=0)
    kv = dtype if kv_dtype is None else kv_dtype
    layout = buffer_layout(batch, chunk_size, max_len, config.hidden_size, eos_slots, dtype=dtype,
                           draft_tokens=draft_tokens, draft_vocab=draft_vocab, long_chunk=long_chunk,
                           vocab=config.vocab_size, logprobs=logprobs, grammar=grammar)
    return cache_bytes(config, batch, max_len, kv, kv_heads=kv_heads) + layout_bytes(layout)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's weights as held: parameters, and quantized weights as stored (int8 / int4 codes and their
    scales; static_decode.model.quant), a tied tensor once."""
    return quant_weight_bytes(model)


def read_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one decode step reads (`weight_bytes` less the embedding rows it does not look up
    where the head has weights of its own; static_decode.model.quant.read_bytes)."""
    return quant_read_bytes(model)


def check_fits(nbytes: int, device: torch.device | str, what: str) -> None:
    """Raise ValueError, sizes in GiB, when `nbytes` for `what` exceed what `device` has free; else nothing.

    e.g. "the KV cache and step buffers need 12.50 GiB on cuda:0, which has 3.20 GiB free".
    """
    nbytes = check_int("nbytes", nbytes, minimum=0)
    free = free_bytes(device)
    if free is None or nbytes <= free:
        return
    raise ValueError(
        f"{what} need {gib(nbytes)} on {torch.device(device)}, which has {gib(free)} free; "
        "use a smaller max_len or batch (or a smaller dtype)"
    )


def _itemsize(dtype: torch.dtype) -> int:
    return _dtype(dtype).itemsize


def _dtype(dtype: torch.dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}: {dtype!r}")
    return dtype
