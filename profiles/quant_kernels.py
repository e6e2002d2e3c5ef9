"""One-row products by a weight in bfloat16, int8 and int4: what each of torch's kernels reads per second.

    OMP_NUM_THREADS=1 python profiles/quant_kernels.py [--shapes smollm2,4096] [--rounds 15] [--json PATH]

A batch-1 decode step multiplies one row by every weight, so a product's time is its weight bytes over the rate
it reads them at; a quantized weight is worth having only where its kernel reads the fewer bytes at least about
as fast per byte as the bfloat16 GEMV reads bfloat16. For each shape [N, K] (SmolLM2-135M's q, k/v, o, gate/up,
down and head, and 4096 x 4096) this times, with the candidates taking turns in every round (a shared machine
changes speed between phases; medians over the rounds):

* bf16 `F.linear` and our `gemv_bf16` (static_decode.kernels.cpu_kernel, where the CPU has AVX512-BF16);
* int8 per output channel: `torch.ops.aten._weight_int8pack_mm`, and gpt-fast's
  `F.linear(x, w.to(x.dtype)) * scales` and its multiply-and-row-sum form compiled by inductor;
* int4 grouped (32 / 64 / 128): `torch.ops.aten._weight_int4pack_mm_for_cpu` on the weight packed by
  `_convert_weight_to_int4pack_for_cpu`;
* ours: `torch.ops.static_decode_cpu.gemv_q` on static_decode.model.quant's int8 and int4-g32 (csrc/gemv_quant.cpp).

GB/s counts the weight's bytes (scales included) per call. Each weight set is several times the last-level cache
and the calls cycle through the copies, so every call reads cold weights from memory, as a decode step does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from static_decode.kernels import cpu_kernel
from static_decode.model import quant
from static_decode.model.quant import QuantWeight

SMOLLM2 = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576),
           "down 576x1536": (576, 1536), "head 49152x576": (49152, 576)}  # fmt: skip
BIG = {"4096x4096": (4096, 4096)}
INT4MM = torch.ops.aten._weight_int4pack_mm_for_cpu
COLD_BYTES = 256 * 1024**2  # copies of each weight, cycled through, so the caches hold none of them


def _copies(nbytes: int) -> int:
    return max(1, min(64, COLD_BYTES // max(nbytes, 1)))


def _int4_pack(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (packed uint8 [N, K/2], scales_and_zeros bf16 [K/group, N, 2]) for _weight_int4pack_mm_for_cpu:
    asymmetric, w = q * scale + (zero - 8 * scale), q in 0..15 (torch's own test quantizer)."""
    N, K = w.shape
    g = w.float().reshape(N, K // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo).clamp(min=1e-6) / 15)
    q = ((g - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(N, K)
    zero = lo + 8 * scale
    sz = torch.cat([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/g, N, 2]
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz


def candidates(N: int, K: int) -> dict[str, tuple[int, Callable[[torch.Tensor, int], torch.Tensor]]]:
    """name -> (weight bytes, fn(x [1, K] bf16, copy index) -> [1, N])."""
    w = torch.randn(N, K, dtype=torch.bfloat16) / K**0.5
    out: dict[str, tuple[int, Callable]] = {}
    n = _copies(w.nbytes)
    ws = [w.clone() for _ in range(n)]
    out["bf16 F.linear"] = (w.nbytes, lambda x, i: F.linear(x, ws[i % n]))
    if cpu_kernel.bf16_dot() and cpu_kernel.available():
        out["bf16 gemv_bf16"] = (w.nbytes, lambda x, i: cpu_kernel.gemv_bf16(x.view(-1), ws[i % n]))
    scale = w.float().abs().amax(1).clamp(min=1e-8) / 127
    q8 = (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    s8 = scale.to(torch.bfloat16)
    b8 = q8.nbytes + s8.nbytes
    n8 = _copies(b8)
    q8s = [q8.clone() for _ in range(n8)]
    out["int8 _weight_int8pack_mm"] = (b8, lambda x, i: torch.ops.aten._weight_int8pack_mm(x, q8s[i % n8], s8))

    def gptfast(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return F.linear(x, q.to(x.dtype)) * s

    def rowsum(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return ((q.float() * x.float()).sum(-1) * s.float()).to(x.dtype)[None]

    cg = torch.compile(gptfast, dynamic=False)
    cr = torch.compile(rowsum, dynamic=False)
    out["int8 compiled linear*scales"] = (b8, lambda x, i: cg(x, q8s[i % n8], s8))
    out["int8 compiled row-sum"] = (b8, lambda x, i: cr(x, q8s[i % n8], s8))
    if cpu_kernel.available():  # ours (csrc/gemv_quant.cpp), on static_decode.model.quant's formats
        for spec in ("int8", "int4-g32"):
            qw = QuantWeight(w, quant.parse(spec))
            nq = _copies(qw.nbytes)
            qs = [(qw.qweight.clone(), qw.scales.clone()) for _ in range(nq)]
            group = qw.scheme.group
            out[f"{spec} gemv_q"] = (
                qw.nbytes, lambda x, i, qs=qs, nq=nq, g=group: torch.ops.static_decode_cpu.gemv_q(x, *qs[i % nq], g)
            )
    for group in (32, 64, 128):
        if K % group:
            continue
        packed, sz = _int4_pack(w, group)
        b4 = packed.nbytes + sz.nbytes
        n4 = _copies(b4)
        ps = [packed.clone() for _ in range(n4)]
        out[f"int4 g{group} _weight_int4pack_mm_for_cpu"] = (
            b4, lambda x, i, ps=ps, n4=n4, g=group, sz=sz: INT4MM(x, ps[i % n4], g, sz)
        )
    return out


def measure(shapes: dict[str, tuple[int, int]], rounds: int, calls: int) -> list[dict]:
    rows = []
    for label, (N, K) in shapes.items():
        cands = candidates(N, K)
        x = torch.randn(1, K, dtype=torch.bfloat16)
        for _name, (_b, fn) in cands.items():  # warm up (compiles)
            for i in range(3):
                fn(x, i)
        times: dict[str, list[float]] = {name: [] for name in cands}
        for _ in range(rounds):
            for name, (_b, fn) in cands.items():
                t0 = time.perf_counter()
                for i in range(calls):
                    fn(x, i)
                times[name].append((time.perf_counter() - t0) / calls)
        for name, (nbytes, _fn) in cands.items():
            s = statistics.median(times[name])
            rows.append({"shape": label, "kernel": name, "bytes": nbytes, "us": s * 1e6, "GBps": nbytes / s / 1e9})
            print(f"{label:18s} {name:40s} {s * 1e6:9.1f} us {nbytes / s / 1e9:6.2f} GB/s", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="smollm2,4096", help="smollm2, 4096 or both, comma-separated")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=20, help="calls per timed sample")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    shapes: dict[str, tuple[int, int]] = {}
    for s in args.shapes.split(","):
        shapes |= SMOLLM2 if s == "smollm2" else BIG
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {torch.backends.cpu.get_cpu_capability()}")
    rows = measure(shapes, args.rounds, args.calls)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
