"""Weights on transparent huge pages (static_decode.base.hugepages): the kernel's mode read from its sysfs text;
a model's parameters and buffers moved into one mapping advised MADV_HUGEPAGE (the kernel's own smaps says the
mapping is eligible) with values, shapes and tying unchanged; `load_model` on the CPU does it; small models and
kernels without THP are left alone.
"""

from __future__ import annotations

import mmap
import os
import sys

import pytest
import torch
from torch import nn

from static_decode.base import hugepages
from static_decode.checkpoints.loading import default_model_path, load_model
from tests.support.memory_maps import mapping_of

THP = sys.platform == "linux" and hugepages.thp_mode() in ("always", "madvise")
needs_thp = pytest.mark.skipif(not THP, reason="no transparent huge pages (Linux, mode always/madvise) here")


@pytest.mark.parametrize(("text", "mode"), [("always [madvise] never\n", "madvise"),
                                            ("[always] madvise never\n", "always"),
                                            ("always madvise [never]\n", "never"), ("", None)])
def test_thp_mode_reads_the_bracketed_choice(tmp_path, text, mode):
    p = tmp_path / "enabled"
    p.write_text(text)
    assert hugepages.thp_mode(p) == mode
    assert hugepages.thp_mode(tmp_path / "missing") is None


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4096, 256)  # 4 MB of float32
        self.head = nn.Linear(256, 4096, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter
        self.norm = nn.Parameter(torch.randn(256))
        self.register_buffer("codes", torch.randint(0, 255, (1000, 333), dtype=torch.uint8))  # odd byte count


@needs_thp
def test_to_huge_pages_moves_every_tensor_keeping_values_and_ties():
    torch.manual_seed(0)
    m = _Tied().requires_grad_(False)
    before = {n: t.clone() for n, t in m.state_dict().items()}
    ids = {n: id(t) for n, t in [*m.named_parameters(), *m.named_buffers()]}
    moved = hugepages.to_huge_pages(m)
    assert moved >= 4096 * 256 * 4 + 1000 * 333
    for n, t in m.state_dict().items():
        assert torch.equal(t, before[n]), n
    assert {n: id(t) for n, t in [*m.named_parameters(), *m.named_buffers()]} == ids  # swapped in place
    assert m.head.weight is m.embed.weight
    ptrs = [t.data_ptr() for t in (m.embed.weight, m.norm, m.codes)]
    assert all(p % hugepages.ALIGN == 0 for p in ptrs)
    assert all(mapping_of(p).get("THPeligible") == "1" for p in ptrs), mapping_of(ptrs[0])
    x = torch.tensor([[1, 4095]])
    w = before["embed.weight"]
    assert torch.equal(m.head(m.embed(x)), torch.nn.functional.linear(w[x], w))


def test_small_models_are_left_alone():
    m = nn.Linear(16, 16)
    ptr = m.weight.data_ptr()
    assert hugepages.to_huge_pages(m) == 0 and m.weight.data_ptr() == ptr


def not_advised_control() -> bool:
    """A fresh anonymous mapping is not advised: `hg` is to_huge_pages' doing, not the kernel's default. (Not a
    malloc'd tensor: numpy advises its large arrays' memory, and malloc may hand that memory out again once freed.)"""
    m = mmap.mmap(-1, 4 * hugepages.HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        return "hg" not in mapping_of(torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr()).get(
            "VmFlags", "").split()
    finally:
        m.close()


@needs_thp
def test_load_model_puts_cpu_weights_on_huge_page_memory():
    """The embedded model (over 2 MB of weights) comes back from `load_model` in an eligible mapping."""
    model = load_model(default_model_path())
    w = model.embed_tokens.weight
    mapping = mapping_of(w.data_ptr())
    assert mapping.get("THPeligible") == "1", mapping
    assert "hg" in mapping.get("VmFlags", "").split(), mapping  # advised MADV_HUGEPAGE, by to_huge_pages
    # ...in to_huge_pages' region, whose first slot starts on a huge page (malloc'd memory, which numpy may have
    # advised for an array freed earlier, does not)
    assert min(t.data_ptr() for t in [*model.parameters(), *model.buffers()]) % hugepages.HUGE_PAGE == 0
    assert not_advised_control() is True


@needs_thp
def test_cpu_kv_cache_is_allocated_on_huge_page_memory(monkeypatch):
    """A CPU StaticKVCache over 2 MB starts in an advised mapping (its K/V and lengths), stays there as it is
    written (never moved), and reads back what was written; a cache under 2 MB keeps its plain allocation."""
    from static_decode.core import cache as cache_module
    from static_decode.core.cache import StaticKVCache

    cache = StaticKVCache(1, 2, 8192, 64, layers=1, dtype=torch.bfloat16)  # K and V 2.1 MB each
    ptrs = {name: getattr(cache, name).data_ptr() for name in ("k", "v", "lens")}
    for name, p in ptrs.items():
        assert "hg" in mapping_of(p).get("VmFlags", "").split(), name
    assert not cache.k.any() and not cache.v.any() and not cache.lens.any()
    k_new = torch.randn(1, 2, 3, 64, dtype=torch.bfloat16)
    v_new = torch.randn(1, 2, 3, 64, dtype=torch.bfloat16)
    cache.append(k_new, v_new, [3])
    assert torch.equal(cache.k[0, :, :, :3], k_new) and torch.equal(cache.v[0, :, :, :3], v_new)
    assert cache.lens.tolist() == [3]
    assert {name: getattr(cache, name).data_ptr() for name in ("k", "v", "lens")} == ptrs
    assert cache.k.data_ptr() % hugepages.HUGE_PAGE == 0  # the region's first slot
    moved = []
    monkeypatch.setattr(cache_module, "to_huge_pages", lambda m: moved.append(hugepages.to_huge_pages(m)))
    StaticKVCache(1, 2, 64, 64, layers=1, dtype=torch.bfloat16)
    assert moved == [0]  # under 2 MB: its plain allocation kept


def test_drop_file_cache_advises_each_file_it_can_open(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append((os.readlink(
        f"/proc/self/fd/{fd}"), off, n, advice)))
    a, b = tmp_path / "a.safetensors", tmp_path / "b.gguf"
    a.write_bytes(b"x" * 10)
    b.write_bytes(b"y")
    hugepages.drop_file_cache([a, tmp_path / "missing", str(b)])
    assert calls == [(str(a), 0, 0, os.POSIX_FADV_DONTNEED), (str(b), 0, 0, os.POSIX_FADV_DONTNEED)]


@needs_thp
def test_load_model_drops_its_files_page_cache_before_the_huge_page_copy(monkeypatch):
    """load_model hands its checkpoint files to to_huge_pages, which advises them DONTNEED before it allocates."""
    advised = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: advised.append(
        os.readlink(f"/proc/self/fd/{fd}")))
    path = default_model_path()
    load_model(path)
    assert advised == [str(path / "model.safetensors")]


def test_huge_page_share_reads_the_mapping_holding_the_address(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "00400000-00600000 r-xp 00000000 fd:01 42 /usr/bin/python3\nSize: 2048 kB\nRss: 1024 kB\n"
        "AnonHugePages: 0 kB\nVmFlags: rd ex\n"
        "7f0000000000-7f0000800000 rw-p 00000000 00:00 0 \nSize: 8192 kB\nRss: 8192 kB\n"
        "AnonHugePages: 6144 kB\nVmFlags: rd wr hg\n"
        "7f0000800000-7f0000a00000 rw-p 00000000 00:00 0 \nSize: 2048 kB\nRss: 0 kB\nAnonHugePages: 0 kB\n")
    assert hugepages.huge_page_share(0x7F0000000000 + 5, smaps) == 0.75
    assert hugepages.huge_page_share(0x7F00007FFFFF, smaps) == 0.75  # the last byte of it
    assert hugepages.huge_page_share(0x7F0000900000, smaps) == 0.0  # nothing resident
    assert hugepages.huge_page_share(0x500000, smaps) == 0.0
    assert hugepages.huge_page_share(0x10, smaps) is None  # no mapping holds it
    assert hugepages.huge_page_share(0x10, tmp_path / "missing") is None


@needs_thp
def test_to_huge_pages_leaves_the_weights_on_huge_pages():
    """What the kernel reports for the mapping after the move: all of it on huge pages (the faults advised, then the
    range collapsed where a fault fell back to 4 KB pages)."""
    m = nn.Linear(1024, 2048, bias=False).requires_grad_(False)  # 8 MB of float32: four huge pages
    assert hugepages.to_huge_pages(m) > 0
    assert hugepages.huge_page_share(m.weight.data_ptr()) == 1.0


def test_trim_heap_runs_anywhere():
    hugepages.trim_heap()  # glibc's malloc_trim, or nothing


@needs_thp
def test_collapse_moves_4kb_pages_onto_huge_pages():
    """A range touched without advice (4 KB pages in the madvise mode) is on huge pages after `collapse`, values
    kept: what to_huge_pages does to the parts of its mapping whose faults fell back to 4 KB pages."""
    size = 4 * hugepages.HUGE_PAGE
    region = mmap.mmap(-1, size + hugepages.HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    start = -base % hugepages.HUGE_PAGE
    region.madvise(mmap.MADV_DONTFORK, start, size)  # a flag of its own: a mapping the kernel does not merge
    t = torch.frombuffer(region, dtype=torch.uint8, count=size, offset=start)
    t.copy_(torch.arange(size, dtype=torch.int64).remainder(251).to(torch.uint8))
    if hugepages.thp_mode() == "madvise":
        assert hugepages.huge_page_share(base + start) == 0.0  # the control: 4 KB pages
    hugepages.collapse(region, start, size)
    assert hugepages.huge_page_share(base + start) == 1.0
    assert torch.equal(t, torch.arange(size, dtype=torch.int64).remainder(251).to(torch.uint8))
    del t
    region.close()
