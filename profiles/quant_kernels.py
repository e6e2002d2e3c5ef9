"""One-row products by a weight in bfloat16, int8 and int4: what each of torch's kernels reads per second.

    OMP_NUM_THREADS=1 python profiles/quant_kernels.py [--shapes smollm2,4096,llama3b] [--rounds 15] \
        [--cold-mb 2048] [--only gemv] [--json PATH]

A batch-1 decode step multiplies one row by every weight, so a product's time is its weight bytes over the rate
it reads them at; a quantized weight is worth having only where its kernel reads the fewer bytes at least about
as fast per byte as the bfloat16 GEMV reads bfloat16. For each shape [N, K] (SmolLM2-135M's q, k/v, o, gate/up,
down and head, and 4096 x 4096) this times, with the candidates taking turns in every round (a shared machine
changes speed between phases; medians over the rounds):

* bf16 `F.linear` and our `gemv_bf16` (static_decode.kernels.cpu_kernel, where the CPU has AVX512-BF16 or AVX2);
* int8 per output channel: `torch.ops.aten._weight_int8pack_mm`, and gpt-fast's
  `F.linear(x, w.to(x.dtype)) * scales` and its multiply-and-row-sum form compiled by inductor;
* int4 grouped (32 / 64 / 128): `torch.ops.aten._weight_int4pack_mm_for_cpu` on the weight packed by
  `_convert_weight_to_int4pack_for_cpu`;
* ours: `torch.ops.static_decode_cpu.gemv_q` on static_decode.model.quant's int8 and int4-g32 (csrc/gemv_quant.cpp).

GB/s counts the weight's bytes (scales included) per call. Each weight's copies fill `--cold-mb` (default 2 GiB,
several times a 504 MiB L3) and the calls cycle through them, so every call reads cold weights from memory, as a
decode step does; the copies sit on transparent huge pages, as a loaded model's weights do (`--pages 4k`: not).
`--shapes llama3b` takes Llama-3.2-3B's projections (q/k/v and gate/up joined, as the model
holds them); `--only gemv` times only the products the decode step runs (gemv_bf16 and gemv_q), which is what
their rates are compared on. Each kernel's format holds its own copies: at the default, the whole list takes ~14 GB
of memory and `--only gemv` ~6 GB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from static_decode.base import hugepages
from static_decode.kernels import cpu_kernel
from static_decode.model import quant
from static_decode.model.quant import QuantWeight

SMOLLM2 = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576),
           "down 576x1536": (576, 1536), "head 49152x576": (49152, 576)}  # fmt: skip
BIG = {"4096x4096": (4096, 4096)}
LLAMA3B = {"qkv 5120x3072": (5120, 3072), "o 3072x3072": (3072, 3072), "gate/up 16384x3072": (16384, 3072),
           "down 3072x8192": (3072, 8192)}  # fmt: skip
SHAPES = {"smollm2": SMOLLM2, "4096": BIG, "llama3b": LLAMA3B}
INT4MM = torch.ops.aten._weight_int4pack_mm_for_cpu
COLD_BYTES = 2048 * 1024**2  # copies of each weight, cycled through, so the caches hold none of them (--cold-mb)


PAGES = "huge"  # where the copies sit (--pages): "huge" as a loaded model's weights (load_model), or "4k"


def _copies(nbytes: int) -> int:
    return max(2, min(256, COLD_BYTES // max(nbytes, 1)))


def _placed(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors moved onto transparent huge pages as load_model moves a model's weights (--pages huge; a product
    streaming 4 KB pages reads slower, so copies on them would not say how fast a decode step's products run)."""
    if PAGES == "huge":
        holder = torch.nn.Module()
        for i, t in enumerate(tensors):
            holder.register_buffer(f"t{i}", t)
        hugepages.to_huge_pages(holder)  # each tensor swapped in place
    return tensors


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


Product = Callable[[torch.Tensor, int], torch.Tensor]


def candidates(N: int, K: int, only_gemv: bool = False) -> dict[str, tuple[int, Product]]:
    """name -> (weight bytes, fn(x [1, K] bf16, copy index) -> [1, N]); `only_gemv`: gemv_bf16 and gemv_q only."""
    w = torch.randn(N, K, dtype=torch.bfloat16) / K**0.5  # [N, K]
    out: dict[str, tuple[int, Callable]] = {}
    n = _copies(w.nbytes)
    ws = _placed([w.clone() for _ in range(n)])
    if not only_gemv:
        out["bf16 F.linear"] = (w.nbytes, lambda x, i: F.linear(x, ws[i % n]))
    if cpu_kernel.bf16_rows() and cpu_kernel.available():
        out["bf16 gemv_bf16"] = (w.nbytes, lambda x, i: cpu_kernel.gemv_bf16(x.view(-1), ws[i % n]))
    if only_gemv:
        del w
        return out | _ours(ws[0], N, K)
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
    out |= _ours(w, N, K)
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


def _ours(w: torch.Tensor, N: int, K: int) -> dict[str, tuple[int, Product]]:
    """gemv_q (csrc/gemv_quant.cpp) on static_decode.model.quant's int8 and int4-g32 forms of w [N, K]."""
    out: dict[str, tuple[int, Callable]] = {}
    if not cpu_kernel.available():
        return out
    for spec in ("int8", "int4-g32"):
        qw = QuantWeight(w, quant.parse(spec))
        nq = _copies(qw.nbytes)
        flat = _placed([t.clone() for _ in range(nq) for t in (qw.qweight, qw.scales)])
        qs = list(zip(flat[::2], flat[1::2], strict=True))
        group = qw.scheme.group
        out[f"{spec} gemv_q"] = (
            qw.nbytes, lambda x, i, qs=qs, nq=nq, g=group: torch.ops.static_decode_cpu.gemv_q(x, *qs[i % nq], g)
        )
    return out


def measure(shapes: dict[str, tuple[int, int]], rounds: int, calls: int, only_gemv: bool = False) -> list[dict]:
    rows = []
    for label, (N, K) in shapes.items():
        cands = candidates(N, K, only_gemv)
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
        ref = "bf16 gemv_bf16" if "bf16 gemv_bf16" in cands else None
        for name, (nbytes, _fn) in cands.items():
            s = statistics.median(times[name])
            # each round's rate over gemv_bf16's in the same round, the median of those: phases cancel
            rel = (statistics.median(nbytes / times[name][r] / (cands[ref][0] / times[ref][r]) for r in range(rounds))
                   if ref is not None else None)
            rows.append({"shape": label, "kernel": name, "bytes": nbytes, "us": s * 1e6, "GBps": nbytes / s / 1e9,
                         "rate_over_gemv_bf16": rel})
            tail = f"  {rel:5.2f} of gemv_bf16's rate" if rel is not None else ""
            print(f"{label:18s} {name:40s} {s * 1e6:9.1f} us {nbytes / s / 1e9:6.2f} GB/s{tail}", flush=True)
        del cands
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="smollm2,4096", help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=20, help="calls per timed sample")
    p.add_argument("--cold-mb", type=int, default=COLD_BYTES // 1024**2,
                   help="MiB of copies each weight's calls cycle through (several times the last-level cache)")
    p.add_argument("--only", choices=("all", "gemv"), default="all",
                   help="gemv: only gemv_bf16 and gemv_q (the decode step's products)")
    p.add_argument("--pages", choices=("huge", "4k"), default="huge",
                   help="the copies on transparent huge pages, as load_model puts weights (default), or 4 KB pages")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    globals()["PAGES"] = args.pages
    shapes: dict[str, tuple[int, int]] = {}
    for s in args.shapes.split(","):
        if s not in SHAPES:
            p.error(f"--shapes: {s!r} is not one of {', '.join(SHAPES)}")
        shapes |= SHAPES[s]
    if args.cold_mb <= 0:
        p.error(f"--cold-mb must be positive, got {args.cold_mb}")
    globals()["COLD_BYTES"] = args.cold_mb * 1024**2
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.cold_mb} MiB of copies a weight")
    rows = measure(shapes, args.rounds, args.calls, args.only == "gemv")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "cold_mb": args.cold_mb, "pages": args.pages,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
