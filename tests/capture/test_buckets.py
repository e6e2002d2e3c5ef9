"""The read-length ladder (rule 5: reads follow the live length through a small captured ladder).

Pins: every legal length gets a rung that covers it; the stated waste bound (rung < growth * L + align);
the last rung is the capacity; modest rung counts at 128k; a length past max_len or a malformed ladder is
refused with an error naming the value.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from capture.buckets import BucketLadder


def test_default_ladder_exact_values() -> None:
    assert BucketLadder.default(4096).lengths == (256, 512, 768, 1280, 2048, 3072, 4096)
    assert BucketLadder.geometric(4096, growth=2.0).lengths == (256, 512, 1024, 2048, 4096)
    assert BucketLadder.geometric(100, align=16, growth=2.0).lengths == (16, 32, 64, 100)
    assert BucketLadder.default(64).lengths == (64,)  # capacity below one alignment step: one rung


@pytest.mark.parametrize(("growth", "most"), [(1.5, 16), (2.0, 10)])
def test_rung_count_is_modest_at_128k(growth: float, most: int) -> None:
    ladder = BucketLadder.geometric(131072, growth=growth)
    assert len(ladder) == most
    assert ladder.max_len == 131072


@settings(max_examples=200, deadline=None)
@given(
    max_len=st.integers(1, 200_000),
    align=st.sampled_from([1, 16, 64, 128, 256]),
    growth=st.sampled_from([1.1, 1.25, 1.5, 2.0, 3.0]),
    frac=st.floats(0.0, 1.0),
)
def test_bucket_covers_length_within_stated_bound(max_len: int, align: int, growth: float, frac: float) -> None:
    ladder = BucketLadder.geometric(max_len, align=align, growth=growth)
    assert ladder.lengths[-1] == max_len
    assert all(b > a for a, b in zip(ladder.lengths, ladder.lengths[1:], strict=False))
    length = max(1, round(frac * max_len))
    rung = ladder.bucket_for(length)
    assert length <= rung <= max_len
    assert rung < growth * length + align
    # the smallest covering rung, checked against a linear scan
    assert rung == min(r for r in ladder.lengths if r >= length)


def test_bucket_for_edges() -> None:
    ladder = BucketLadder((16, 32, 64))
    assert [ladder.bucket_for(n) for n in (0, 1, 16, 17, 32, 33, 64)] == [16, 16, 16, 32, 32, 64, 64]
    assert ladder.bucket_for(np.int64(20)) == 32  # host mirror values are numpy ints
    assert ladder.touched([1, 5, 40, 64]) == (16, 64)


def test_length_past_capacity_is_refused() -> None:
    ladder = BucketLadder((16, 32, 64))
    with pytest.raises(ValueError, match="length 65 exceeds the cache capacity max_len=64"):
        ladder.bucket_for(65)
    with pytest.raises(ValueError, match="length must be an int >= 0, got -1"):
        ladder.bucket_for(-1)
    with pytest.raises(TypeError, match="length must be an int"):
        ladder.bucket_for(3.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("lengths", "error", "match"),
    [
        ((), ValueError, "at least one"),
        ((16, 16, 32), ValueError, r"strictly increasing; lengths\[0\]=16 >= lengths\[1\]=16"),
        ((32, 16), ValueError, "strictly increasing"),
        ((0, 16), ValueError, r"lengths\[0\] must be an int >= 1, got 0"),
        ((16, 32.0), TypeError, r"lengths\[1\] must be an int"),
        ("abc", TypeError, "sequence of ints"),
    ],
)
def test_malformed_ladder_is_refused(lengths: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        BucketLadder(lengths)  # type: ignore[arg-type]


def test_geometric_parameters_are_checked() -> None:
    with pytest.raises(ValueError, match="growth must be > 1"):
        BucketLadder.geometric(1024, growth=1.0)
    with pytest.raises(ValueError, match="align must be an int >= 1, got 0"):
        BucketLadder.geometric(1024, align=0)
    with pytest.raises(ValueError, match="max_len must be an int >= 1, got 0"):
        BucketLadder.geometric(0)


def test_of_normalises_user_choice_and_requires_capacity_as_last_rung() -> None:
    assert BucketLadder.of(None, 4096) == BucketLadder.default(4096)
    assert BucketLadder.of([8, 64], 64).lengths == (8, 64)
    with pytest.raises(ValueError, match="last rung is 32, the cache capacity is max_len=64"):
        BucketLadder.of([16, 32], 64)


def test_fine_ladder_is_the_default_where_the_read_length_is_symbolic():
    from capture import CaptureOptions, CompileSettings
    from static_decode import Generator, Llama, LlamaConfig

    assert BucketLadder.fine(2048).lengths == (128, 256, 384, 512, 640, 896, 1152, 1536, 1920, 2048)
    assert BucketLadder.of(None, 2048, fine=True) == BucketLadder.fine(2048)
    assert BucketLadder.of([8, 2048], 2048, fine=True).lengths == (8, 2048)  # a user's ladder wins
    config = LlamaConfig(vocab_size=50, hidden_size=24, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    model = Llama(config, dtype=torch.float32)
    lazy = {"warm_up": "lazy", "progress": False}
    cpu = Generator(model, max_len=2048, batch=1, compile=True, capture=CaptureOptions(**lazy))
    assert cpu.runner.settings.symbolic_read_len and cpu.runner.ladder == BucketLadder.fine(2048)
    static = CaptureOptions(settings=CompileSettings(backend="aot_eager"), **lazy)
    gen = Generator(model, max_len=2048, batch=1, compile=True, capture=static)
    assert not gen.runner.settings.symbolic_read_len and gen.runner.ladder == BucketLadder.default(2048)
