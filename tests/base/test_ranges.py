"""NVTX ranges (static_decode/base/ranges.py): balanced push/pop with the right names, and a no-op without nvtx.

Pins: a range pops even when the body raises (an unbalanced NVTX stack corrupts every later range in the
Nsight timeline); the names are the documented ones; the library imports and runs when `nvtx` is missing.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest

import static_decode.base.ranges as ranges


@pytest.fixture
def reload_ranges():
    """Reload static_decode.base.ranges under a patched sys.modules; restore the real module afterwards."""

    def load(nvtx_module):
        sys.modules["nvtx"] = nvtx_module  # None makes `import nvtx` raise ImportError
        return importlib.reload(ranges)

    saved = sys.modules.get("nvtx", None)
    had = "nvtx" in sys.modules
    yield load
    if had:
        sys.modules["nvtx"] = saved
    else:
        sys.modules.pop("nvtx", None)
    importlib.reload(ranges)


class FakeDomain:  # stands for nvtx.Domain, the class of a live (tool-attached) domain
    pass


class RecordingDomain(FakeDomain):
    def __init__(self, name):
        self.name = name
        self.events = []

    def get_event_attributes(self, message=None, color=None):
        return ("attrs", message, color)

    def push_range(self, attributes):
        self.events.append(("push", attributes[1], attributes[2]))

    def pop_range(self):
        self.events.append(("pop",))


def fake_nvtx():
    module = types.ModuleType("nvtx")
    module.domains = {}

    def get_domain(name=None):
        return module.domains.setdefault(name, RecordingDomain(name))

    module.get_domain = get_domain
    module.Domain = FakeDomain
    return module


def test_names_follow_the_documented_scheme():
    assert ranges.PREFILL_CHUNK == "prefill/chunk"
    assert ranges.DECODE_STEP == "decode/step"
    assert ranges.SAMPLE == "sample"
    assert ranges.capture_name("decode", 512) == "capture/decode/512"
    assert ranges.bench_name("prefill") == "bench/prefill"


def test_context_and_decorator_push_and_pop_in_order(reload_ranges):
    fake = fake_nvtx()
    r = reload_ranges(fake)
    assert r.AVAILABLE

    @r.range(r.SAMPLE)
    def sample(x):
        return x + 1

    with r.range(r.DECODE_STEP):
        assert sample(1) == 2
    with r.range(r.capture_name("decode", 64), color="red"):
        pass
    events = fake.domains[r.DOMAIN].events
    assert events == [
        ("push", "decode/step", "blue"),
        ("push", "sample", "orange"),
        ("pop",),
        ("pop",),
        ("push", "capture/decode/64", "red"),
        ("pop",),
    ]
    assert sample.__name__ == "sample"  # functools.wraps kept the decorated function's identity


def test_range_pops_when_the_body_raises(reload_ranges):
    fake = fake_nvtx()
    r = reload_ranges(fake)

    @r.range("bench/boom")
    def boom():
        raise KeyError("x")

    with pytest.raises(RuntimeError), r.range(r.PREFILL_CHUNK):
        raise RuntimeError("inside")
    with pytest.raises(KeyError):
        boom()
    events = fake.domains[r.DOMAIN].events
    assert [e[0] for e in events] == ["push", "pop", "push", "pop"]


def test_without_nvtx_ranges_are_noops(reload_ranges):
    r = reload_ranges(None)
    assert not r.AVAILABLE

    def f(x):
        return 2 * x

    assert r.range(r.SAMPLE)(f) is f  # the decorator costs nothing: it returns the function itself
    with r.range(r.DECODE_STEP) as entered:
        pass
    assert entered is r.range("anything")
    with pytest.raises(ValueError), r.range(r.SAMPLE):
        raise ValueError("not swallowed")


def test_real_nvtx_package_if_installed():
    nvtx = pytest.importorskip("nvtx")
    r = importlib.reload(ranges)
    assert r.AVAILABLE
    if not isinstance(nvtx.get_domain(r.DOMAIN), nvtx.Domain):  # no profiler attached: the shared no-op
        assert r.range(r.DECODE_STEP) is r.range(r.SAMPLE) is r._NULL

    @r.range(r.SAMPLE)
    def f(x):
        return x * 3

    with r.range(r.DECODE_STEP), r.range(r.capture_name("prefill", 128)):
        assert f(2) == 6


@pytest.mark.parametrize("bad", ["", None, 3, ["decode/step"]])
def test_bad_names_are_refused(bad):
    with pytest.raises(ValueError, match="non-empty str"):
        ranges.range(bad)
