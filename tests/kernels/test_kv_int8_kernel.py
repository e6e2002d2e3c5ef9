"""The CPU decode kernel over an int8 cache (csrc/decode_attention_int8.cpp): against the float64 reference over the
dequantized K/V, keys outside a row's visible band never read (NaN scales there change nothing), and hostile
arguments refused with the value named (run in a subprocess, so a crash fails a test instead of ending pytest).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from static_decode.core import kv_quant
from static_decode.core.reference import attention_vectorised
from static_decode.kernels import cpu_kernel

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernels did not build here")


def _cache(B: int, hkv: int, S: int, d: int, seed: int):
    """Codes and scales as an int8 cache holds them: views of [B, Hkv, S + 2, d] buffers (a spare row past S)."""
    gen = torch.Generator().manual_seed(seed)
    pairs = [kv_quant.quantize(torch.randn(B, hkv, S + 2, d, generator=gen) * 3) for _ in range(2)]
    codes, scales = zip(*pairs, strict=True)
    return [c[:, :, :S] for c in codes], [s[:, :, :S] for s in scales]


@pytest.mark.parametrize("d", cpu_kernel.head_dims()[:4] + (128,))
@pytest.mark.parametrize("T, window", [(1, None), (4, None), (1, 37), (3, 200)])
def test_kernel_equals_the_reference_over_the_dequantized_cache(d: int, T: int, window: int | None) -> None:
    B, hkv, G, S = 3, 2, 3, 700  # over one split of 512 keys: the combine joins several work items
    (k, v), (ks, vs) = _cache(B, hkv, S, d, seed=d + T)
    lens = torch.tensor([690, T, 300])
    n_new = torch.tensor([T, T, 0])  # row 2 appends nothing: zeros
    q = torch.randn(B, hkv * G, T, d, generator=torch.Generator().manual_seed(1))
    out = cpu_kernel.decode_attention_int8(q, k, v, ks, vs, lens, n_new, window=window)
    kf, vf = (kv_quant.dequantize(c, s).double().numpy() for c, s in ((k, ks), (v, vs)))
    want = attention_vectorised(q.double().numpy(), kf, vf, lens.numpy(), n_new.numpy(), window)
    np.testing.assert_allclose(out.double().numpy(), want, atol=2e-5, rtol=1e-5)
    assert not out[2].any()


@pytest.mark.parametrize("d", [x for x in cpu_kernel.head_dims() if x % 32 == 0][:3] + [128])
@pytest.mark.parametrize("T, window", [(1, None), (3, 200)])
def test_bfloat16_queries_over_many_blocks_equal_the_reference(d: int, T: int, window: int | None) -> None:
    """bfloat16 queries score the codes converted to bfloat16 (exact) by AVX512-BF16 dot products where the CPU
    has them: the same softmax over the same keys as the float64 reference, to the output's bfloat16 rounding."""
    B, hkv, G, S = 2, 2, 3, 700
    (k, v), (ks, vs) = _cache(B, hkv, S, d, seed=2 * d + T)
    lens, n_new = torch.tensor([690, 333]), torch.tensor([T, T])
    q = torch.randn(B, hkv * G, T, d, generator=torch.Generator().manual_seed(d)).to(torch.bfloat16)
    out = cpu_kernel.decode_attention_int8(q, k, v, ks, vs, lens, n_new, window=window)
    kf, vf = (kv_quant.dequantize(c, s).double().numpy() for c, s in ((k, ks), (v, vs)))
    want = attention_vectorised(q.double().numpy(), kf, vf, lens.numpy(), n_new.numpy(), window)
    np.testing.assert_allclose(out.double().numpy(), want, atol=4e-3, rtol=8e-3)  # bfloat16: 2^-8 relative


def test_bfloat16_queries_come_back_in_bfloat16() -> None:
    (k, v), (ks, vs) = _cache(1, 2, 64, 64, seed=4)
    q = torch.randn(1, 4, 1, 64).to(torch.bfloat16)
    lens, n_new = torch.tensor([50]), torch.tensor([1])
    out = cpu_kernel.decode_attention_int8(q, k, v, ks, vs, lens, n_new)
    assert out.dtype == torch.bfloat16
    kf, vf = (kv_quant.dequantize(c, s).double().numpy() for c, s in ((k, ks), (v, vs)))
    want = attention_vectorised(q.double().numpy(), kf, vf, lens.numpy(), n_new.numpy())
    np.testing.assert_allclose(out.double().numpy(), want, atol=1e-2, rtol=1e-2)


def test_keys_outside_the_band_are_never_read() -> None:
    """NaN scales past each row's length and before its window: read, they would make the output NaN."""
    (k, v), (ks, vs) = _cache(2, 2, 300, 32, seed=9)
    lens, n_new, window = torch.tensor([250, 90]), torch.tensor([1, 1]), 64
    clean = cpu_kernel.decode_attention_int8(torch.ones(2, 4, 1, 32), k, v, ks, vs, lens, n_new, window=window)
    for s in (ks, vs):
        for b, n in enumerate(lens.tolist()):
            s[b, :, n:] = float("nan")
            s[b, :, : n - window] = float("nan")
    out = cpu_kernel.decode_attention_int8(torch.ones(2, 4, 1, 32), k, v, ks, vs, lens, n_new, window=window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean, rtol=0, atol=0)


HOSTILE = textwrap.dedent("""
    import json, torch
    from static_decode.core import kv_quant
    from static_decode.kernels import cpu_kernel
    assert cpu_kernel.available()
    op = torch.ops.static_decode_cpu.decode_attention_int8
    def base():
        k, ks = kv_quant.quantize(torch.randn(1, 2, 9, 16))
        v, vs = kv_quant.quantize(torch.randn(1, 2, 9, 16))
        return dict(q=torch.randn(1, 2, 2, 16), k=k, v=v, ks=ks, vs=vs, lens=torch.tensor([5]), n=torch.tensor([1]))
    cases = {
        "float scales half": dict(ks=torch.ones(1, 2, 9, dtype=torch.float16)),
        "short scales": dict(vs=torch.ones(1, 2, 8)),
        "rank 4 scales": dict(ks=torch.ones(1, 2, 9, 1)),
        "strided scales": dict(ks=torch.ones(1, 2, 18)[:, :, ::2]),
        "float codes": dict(k=torch.zeros(1, 2, 9, 16)),
        "mixed codes": dict(v=torch.zeros(1, 2, 9, 16, dtype=torch.uint8)),
        "length past the read": dict(lens=torch.tensor([10])),
        "negative length": dict(lens=torch.tensor([-3]), n=torch.tensor([0])),
        "n_new past the slots": dict(n=torch.tensor([3])),
        "undefined scales": dict(ks=None),
    }
    for name, change in cases.items():
        a = base()
        a.update(change)
        before = [t.clone() for t in (a["k"], a["v"], a["ks"], a["vs"]) if t is not None]
        try:
            op(a["q"], a["k"], a["v"], a["ks"], a["vs"], a["lens"], a["n"], 2, 0.25, 0)
            got = "no error"
        except (RuntimeError, TypeError) as err:
            got = str(err).splitlines()[0]
        after = [t for t in (a["k"], a["v"], a["ks"], a["vs"]) if t is not None]
        same = all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
        print(json.dumps({"case": name, "error": got, "unchanged": same}), flush=True)
""")

EXPECT = {
    "float scales half": "k_scale must be float32",
    "short scales": "v_scale",
    "rank 4 scales": "must be [B, H, S]",
    "strided scales": "key axis must be contiguous",
    "float codes": "int8 codes for both",
    "mixed codes": "int8 codes for both",
    "length past the read": "lens[0] = 10",
    "negative length": "lens[0] = -3",
    "n_new past the slots": "n_new[0] = 3",
    "undefined scales": "",
}


def test_hostile_arguments_are_refused_naming_the_value() -> None:
    run = subprocess.run([sys.executable, "-c", HOSTILE], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["case"]: r for r in map(json.loads, run.stdout.splitlines())}
    assert set(rows) == set(EXPECT)
    for name, want in EXPECT.items():
        assert rows[name]["error"] != "no error" and want in rows[name]["error"], rows[name]
        assert rows[name]["unchanged"], name
