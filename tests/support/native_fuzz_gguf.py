"""Fuzzing the GGUF block ops (csrc/gguf_ops.cpp) in a process of their own (tests/kernels/test_gguf_kernel.py runs
`python -m tests.support.native_fuzz_gguf EXAMPLES TRAIL`): seeded random calls of gemv_gguf, linear_gguf and
dequant_gguf, valid and broken (unknown types, other dtypes and ranks, partial blocks, strided blocks, rows of the
wrong width or count, zero sizes, blocks of raw random bytes whose float16 scales are NaN or infinite). Validity is
decided from the tensors passed; a valid call must give the reference (gguf's dequantization, the float64 product of
the row codes), a broken one a RuntimeError from the op's own checks, and no call may change its inputs. Each case
is written to TRAIL before it runs, so a crash names it. Prints "ran REFUSED" last.
"""

from __future__ import annotations

import random
import sys
import warnings

import torch

from static_decode.kernels import cpu_kernel
from static_decode.model.gguf_dequant import BLOCK_TYPES
from tests.support.gguf_blocks import gguf_dequantized, random_blocks

OPS = torch.ops.static_decode_cpu
NUMBERS = {t.number: name for name, t in BLOCK_TYPES.items()}
BAD_TYPES = (0, 1, 4, 9, 10, 11, 15, 16, -1, 2**40)


def draw(rng: random.Random) -> tuple[str, int, torch.Tensor, torch.Tensor | None, torch.dtype]:
    op = rng.choice(["gemv_gguf", "linear_gguf", "dequant_gguf"])
    number = rng.choice([*NUMBERS] * 7 + list(BAD_TYPES)[:3]) if rng.random() < 0.9 else rng.choice(BAD_TYPES)
    kind = NUMBERS.get(number, rng.choice(list(BLOCK_TYPES)))
    t = BLOCK_TYPES[kind]
    n = rng.choice([0] + [1, 3, 17, 40] * 5)
    k = t.weights * rng.choice([0] + [1, 2, 3] * 6)
    blocks = random_blocks(kind, max(n, 1), max(k, t.weights), seed=rng.randrange(10**6))[:n]
    if k == 0:
        blocks = blocks[:, :0]
    form = rng.choice(["plain"] * 40 + ["raw"] * 3 + ["cut", "strided", "int8", "rank1", "rank3", "float"])
    if form == "raw":
        blocks = torch.randint(0, 256, blocks.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    elif form == "cut" and blocks.shape[1] > 1:
        blocks = blocks[:, : blocks.shape[1] - rng.randrange(1, min(blocks.shape[1], t.bytes))].contiguous()
    elif form == "strided":
        blocks = torch.cat([blocks, blocks], 1)[:, ::2]
    elif form == "int8":
        blocks = blocks.view(torch.int8)
    elif form == "rank1":
        blocks = blocks.reshape(-1)
    elif form == "rank3":
        blocks = blocks.unsqueeze(0)
    elif form == "float":
        blocks = blocks.float()
    rows = 1 if op == "gemv_gguf" else rng.choice([1, 2, 5])
    width = k + rng.choice([0] * 20 + [-32, 32, 1])
    shape = rng.choice([(rows, width)] * 20 + [(width,), (0, width), (2, width), (1, 1, width)])
    x = torch.empty(0)
    if all(s >= 0 for s in shape):
        x = (torch.randn(*shape, generator=torch.Generator().manual_seed(width)) * 2)
        x = x.to(rng.choice([torch.float32] * 9 + [torch.bfloat16] * 9 + [torch.float16, torch.float64]))
        if rng.random() < 0.2 and x.numel():
            x.view(-1)[rng.randrange(x.numel())] = rng.choice([float("nan"), float("inf")])
    dtype = rng.choice([torch.float32] * 9 + [torch.bfloat16] * 9 + [torch.float16, torch.int32])
    return op, number, blocks, x, dtype


def valid(op: str, number: int, blocks: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> bool:
    if number not in NUMBERS:
        return False
    t = BLOCK_TYPES[NUMBERS[number]]
    if not (blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.shape[0] > 0 and blocks.shape[1] > 0
            and blocks.shape[1] % t.bytes == 0 and blocks.is_contiguous()):
        return False
    k = blocks.shape[1] // t.bytes * t.weights
    if op == "dequant_gguf":
        return dtype in (torch.float32, torch.bfloat16)
    rows_ok = x.shape[0] == 1 if op == "gemv_gguf" else x.shape[0] > 0
    return x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and rows_ok and x.shape[1] == k


def check(op: str, number: int, blocks: torch.Tensor, x: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> None:
    kind = NUMBERS[number]
    w = gguf_dequantized(blocks, kind)
    if op == "dequant_gguf":
        same = out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
        want = w.to(dtype).view(same.dtype)
        assert torch.equal(same, want) or (w.isnan().any() and torch.equal(out.isnan(), w.to(dtype).isnan())), kind
        return
    if not w.isfinite().all():
        return  # NaN / infinite scales: any value, but no crash
    if op == "gemv_gguf":
        codes = cpu_kernel.row_codes8(x)
        want = w.double() @ codes
        bound = 1e-5 * (w.double().abs() @ codes.abs()) + want.abs() * (2**-8 if x.dtype == torch.bfloat16 else 0)
        got = out.double().reshape(-1)
        finite = want.isfinite()
        assert (got[~finite].isnan() | got[~finite].isinf()).all(), kind
        assert ((got[finite] - want[finite]).abs() <= bound[finite] + 1e-30).all(), kind
        return
    if x.isfinite().all():
        want = x.float() @ w.t()
        tol = 1e-4 if x.dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol * max(1.0, float(want.abs().max())))


def main() -> None:
    examples, trail = int(sys.argv[1]), open(sys.argv[2], "w")  # noqa: SIM115
    assert cpu_kernel.available()
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # gguf's numpy on NaN scales
    rng = random.Random(20261207)
    ran = refused = 0
    for i in range(examples):
        op, number, blocks, x, dtype = draw(rng)
        trail.write(f"{i} {op} type {number} blocks {blocks.dtype} {tuple(blocks.shape)} x {x.dtype} "
                    f"{tuple(x.shape)} {dtype}\n")
        trail.flush()
        before = (blocks.clone(), x.clone())
        try:
            out = (OPS.gemv_gguf(x, blocks, number) if op == "gemv_gguf"
                   else OPS.linear_gguf(x, blocks, number) if op == "linear_gguf"
                   else OPS.dequant_gguf(blocks, number, dtype))
        except RuntimeError as e:
            assert not valid(op, number, blocks, x, dtype), f"case {i}: a valid call refused: {e}"
            assert str(e).startswith(op), f"case {i}: not the op's own check: {e}"
            refused += 1
        else:
            assert valid(op, number, blocks, x, dtype), f"case {i}: a broken call ran"
            check(op, number, blocks, x, dtype, out)
            ran += 1
        assert torch.equal(before[0], blocks) and torch.equal(before[1].nan_to_num(), x.nan_to_num()), i
    print(ran, refused)


if __name__ == "__main__":
    main()
