"""static_decode.generation.memory: the byte count of a Generator's allocation is exact, and a size the device cannot
hold is refused in GiB before anything is allocated."""

from __future__ import annotations

import pytest
import torch

from static_decode import Generator
from static_decode.base import free_memory
from static_decode.core.cache import StaticKVCache
from static_decode.generation import memory
from static_decode.model.config import LlamaConfig
from static_decode.model.llama import Llama
from static_decode.steps.functions import StepBuffers


def small_config(**kw) -> LlamaConfig:
    args = dict(vocab_size=50, hidden_size=24, intermediate_size=32, num_layers=3, num_heads=6, num_kv_heads=2)
    return LlamaConfig(**(args | kw))


def allocated_bytes(cache: StaticKVCache, bufs: StepBuffers) -> int:
    """What a real allocation holds on the device: the cache's buffers (k, v, lens) and every step buffer."""
    return sum(t.nbytes for t in cache.buffers()) + sum(t.nbytes for t in bufs.tensors().values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("batch", "max_len", "chunk", "eos", "long"), [(1, 2, 1, 0, 0), (3, 37, 8, 1, 16), (2, 100, 64, 3, 512)]
)
def test_generation_bytes_equals_a_real_allocation(dtype, batch, max_len, chunk, eos, long):
    c = small_config()
    cache = StaticKVCache(batch, c.num_kv_heads, max_len, c.head_dim, layers=c.num_layers, dtype=dtype)
    bufs = StepBuffers.allocate(
        batch, chunk, max_len, c.hidden_size, eos, dtype=dtype, device=torch.device("cpu"), long_chunk=long,
        vocab=c.vocab_size,
    )
    want = memory.generation_bytes(c, batch, max_len, chunk, eos, dtype, long_chunk=long)
    assert want == allocated_bytes(cache, bufs)


def test_generation_bytes_of_a_generator_includes_what_it_allocated():
    model = Llama(small_config(eos_token_ids=(4, 7)), dtype=torch.float32)
    gen = Generator(model, max_len=40, chunk_size=5, batch=2)
    assert gen.long_chunk == 512  # the default long prefill chunk has its own buffer
    want = memory.generation_bytes(
        model.config, 2, 40, 5, 2, torch.float32, kv_heads=model.kv_heads, long_chunk=gen.long_chunk
    )
    assert want == allocated_bytes(gen.cache, gen.bufs)


def test_kv_heads_is_a_tensor_parallel_share():
    c = small_config(num_kv_heads=2)
    whole = memory.cache_bytes(c, 1, 10, torch.float32) - 8  # minus the lengths
    assert memory.cache_bytes(c, 1, 10, torch.float32, kv_heads=1) - 8 == whole // 2


def test_a_huge_max_len_is_counted_without_overflow():
    c = small_config()
    n = memory.generation_bytes(c, 1, 10**15, 64, 1, torch.bfloat16)
    assert n > 2 * c.num_layers * c.num_kv_heads * c.head_dim * 10**15 * 2  # Python ints: no wraparound


def test_check_fits_refuses_in_gib(monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda device: int(3.2 * memory.GIB))
    memory.check_fits(3 * memory.GIB, "cpu", "the KV cache and step buffers")  # fits: nothing happens
    with pytest.raises(ValueError) as info:
        memory.check_fits(int(12.5 * memory.GIB), "cuda:0", "the KV cache and step buffers")
    assert str(info.value).startswith("the KV cache and step buffers need 12.50 GiB on cuda:0, which has 3.20 GiB free")


def test_check_fits_skips_when_free_memory_is_unknown(monkeypatch, tmp_path):
    monkeypatch.setattr(free_memory, "MEMINFO", tmp_path / "absent")
    assert memory.free_bytes("cpu") is None
    memory.check_fits(10**30, "cpu", "x")  # no number to compare with: not refused
    assert memory.free_bytes("meta") is None


def test_cpu_free_memory_is_meminfo_mem_available(monkeypatch, tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    2000000 kB\n")
    monkeypatch.setattr(free_memory, "MEMINFO", info)
    assert memory.free_bytes("cpu") == 2000000 * 1024
    with pytest.raises(ValueError, match=r"need 1\.91 GiB on cpu, which has 1\.91 GiB free"):
        memory.check_fits(2000000 * 1024 + 1, torch.device("cpu"), "the KV cache and step buffers")


def test_a_generator_refuses_a_huge_max_len_before_allocating(monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda device: 2 * memory.GIB)  # the same on every machine
    model = Llama(small_config(), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"the KV cache and step buffers need [\d.]+ GiB on cpu, which has 2\.00 GiB"):
        Generator(model, max_len=10**12, batch=1)
    gen = Generator(model, max_len=10**12)  # no batch: allocated at the first request
    with pytest.raises(ValueError, match="GiB"):
        gen.generate([1, 2, 3], 4)
    assert gen.cache is None and gen.bufs is None  # refused before anything was allocated


def test_a_refused_regrow_keeps_the_current_cache(monkeypatch):
    model = Llama(small_config(), dtype=torch.float32)
    gen = Generator(model, max_len=64)
    gen.generate([1, 2, 3], 4)
    cache, bufs = gen.cache, gen.bufs
    monkeypatch.setattr(memory, "free_bytes", lambda device: 1)
    with pytest.raises(ValueError, match="GiB"):
        gen.generate([[1, 2, 3], [4, 5, 6]], 4)  # a bigger batch would reallocate
    assert gen.cache is cache and gen.bufs is bufs


def test_the_real_free_memory_refuses_a_huge_cache():
    if memory.free_bytes("cpu") is None:
        pytest.skip("no /proc/meminfo here")
    with pytest.raises(ValueError, match="GiB"):
        Generator(Llama(small_config(), dtype=torch.float32), max_len=10**12, batch=1)
