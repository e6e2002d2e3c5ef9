"""The cost of growing the KV cache by concatenation, measured against writing into the preallocated cache.

    python profiles/concat_cost.py [--steps 4096] [--dtype bfloat16] [--json PATH]

BASELINE, deliberately naive: the "concat" loop below is what rule 1 forbids (`torch.cat` of the whole cache
every step). It lives here to be measured, and the library never imports this file.

One Llama-3.1-8B layer's KV shape (Hkv 8, d 128, B 1) for `--steps` decode steps, one token per step:

* concat: k = torch.cat([k, k_new], dim=2), likewise v. Step i allocates and writes a fresh (i+1)-token cache,
  so the bytes copied are sum_i (i+1) * kv_bytes_per_token: quadratic in the number of tokens.
* preallocated: StaticKVCache(1, 8, steps, 128).write + advance (the device half of a step, no host work), and
  the checked `append` (host validation + write + advance). Each writes one token's K and V in place.

docs/architecture.md's arithmetic, for comparison: Llama 3.1 8B holds 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 B
(bf16) = 131,072 B of KV per token; concatenating for 4,096 tokens copies sum_{i=1..4096} i x 131,072 B
= 1.1e12 B (~1 TiB) across the 32 layers, 1/32 of that (~32 GiB) for the one layer measured here.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from static_decode.core.cache import StaticKVCache

KV_HEADS, HEAD_DIM, LAYERS = 8, 128, 32  # Llama-3.1-8B
BATCH = 1


def kv_bytes_per_token(dtype: torch.dtype, layers: int = 1) -> int:
    """Bytes of K and V that one token adds to `layers` layers."""
    return 2 * layers * KV_HEADS * HEAD_DIM * torch.empty((), dtype=dtype).element_size()


def concat_bytes_copied(steps: int, dtype: torch.dtype, layers: int = 1) -> int:
    """Bytes written by growing the cache with torch.cat for `steps` one-token steps: sum_i i * per-token."""
    return steps * (steps + 1) // 2 * kv_bytes_per_token(dtype, layers)


def run_concat(new_k: torch.Tensor, new_v: torch.Tensor) -> tuple[float, int]:
    """The naive loop. new_k/new_v: [steps, B, Hkv, 1, d]. Returns (seconds, bytes written by torch.cat)."""
    k = new_k[0]  # [B, Hkv, 1, d]
    v = new_v[0]
    copied = k.nbytes + v.nbytes
    t0 = time.perf_counter()
    for i in range(1, new_k.shape[0]):
        k = torch.cat([k, new_k[i]], dim=2)  # [B, Hkv, i+1, d]: a fresh allocation, the whole cache copied
        v = torch.cat([v, new_v[i]], dim=2)
        copied += k.nbytes + v.nbytes
    seconds = time.perf_counter() - t0
    return seconds, copied


def _write_advance(cache: StaticKVCache, k_new: torch.Tensor, v_new: torch.Tensor, n_new: torch.Tensor) -> None:
    cache.write(0, k_new, v_new, n_new)
    cache.advance(n_new)


def run_prealloc(
    new_k: torch.Tensor, new_v: torch.Tensor, *, checked: bool, compiled: bool = False
) -> tuple[float, int]:
    """In-place writes into a StaticKVCache sized for every step. Returns (seconds, bytes written).

    compiled: the device half (write + advance) as one torch.compile'd function, as a compiled step runs it;
    compiled once before the timing on a scratch cache.
    """
    steps = new_k.shape[0]
    one = torch.ones(BATCH, dtype=torch.int64)
    host_one = one.numpy()
    step = _write_advance
    if compiled:
        step = torch.compile(_write_advance, dynamic=False, fullgraph=True)
        scratch = StaticKVCache(BATCH, KV_HEADS, steps, HEAD_DIM, dtype=new_k.dtype)
        for i in range(3):
            step(scratch, new_k[i].clone(), new_v[i].clone(), one)
    cache = StaticKVCache(BATCH, KV_HEADS, steps, HEAD_DIM, dtype=new_k.dtype)
    if compiled:
        step(cache, new_k[0].clone(), new_v[0].clone(), one)  # a new cache object: trace for it outside timing
        cache.reset()
    ptr = cache.k.data_ptr()
    k_in, v_in = new_k[0].clone(), new_v[0].clone()  # static inputs, as a compiled step has
    t0 = time.perf_counter()
    for i in range(steps):
        if checked:
            cache.append(new_k[i], new_v[i], host_one)
        elif compiled:
            k_in.copy_(new_k[i])
            v_in.copy_(new_v[i])
            step(cache, k_in, v_in, one)
        else:
            step(cache, new_k[i], new_v[i], one)
    seconds = time.perf_counter() - t0
    if not checked:
        cache.commit(host_one * steps)
    if cache.k.data_ptr() != ptr or cache.longest() != steps:
        raise RuntimeError("the preallocated cache moved or miscounted: the measurement is void")
    return seconds, steps * (new_k[0].nbytes + new_v[0].nbytes)


def measure(
    steps: int = 4096, dtype: torch.dtype = torch.bfloat16, seed: int = 0, compiled: bool = False
) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    shape = (steps, BATCH, KV_HEADS, 1, HEAD_DIM)
    new_k = torch.randn(shape, generator=gen).to(dtype)  # [steps, B, Hkv, 1, d]
    new_v = torch.randn(shape, generator=gen).to(dtype)
    concat_s, concat_b = run_concat(new_k, new_v)
    if concat_b != concat_bytes_copied(steps, dtype):
        raise RuntimeError(f"counted {concat_b} B copied, the formula says {concat_bytes_copied(steps, dtype)}")
    device_s, device_b = run_prealloc(new_k, new_v, checked=False)
    checked_s, checked_b = run_prealloc(new_k, new_v, checked=True)
    extra = []
    if compiled:
        comp_s, comp_b = run_prealloc(new_k, new_v, checked=False, compiled=True)
        extra.append({"system": "preallocated write+advance, compiled", "seconds": comp_s, "bytes_copied": comp_b})
    return {
        "steps": steps,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": {"batch": BATCH, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "layers_measured": 1},
        "threads": torch.get_num_threads(),
        "readme_arithmetic": {
            "kv_bytes_per_token_32_layers": kv_bytes_per_token(dtype, LAYERS),
            "concat_bytes_32_layers": concat_bytes_copied(steps, dtype, LAYERS),
        },
        "rows": [
            {"system": "concat (torch.cat per step)", "seconds": concat_s, "bytes_copied": concat_b},
            {"system": "preallocated write+advance", "seconds": device_s, "bytes_copied": device_b},
            {"system": "preallocated append (checked)", "seconds": checked_s, "bytes_copied": checked_b},
            *extra,
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4096)
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    parser.add_argument("--compile", action="store_true", help="also time write+advance under torch.compile")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be >= 2, got {args.steps}")
    result = measure(args.steps, getattr(torch, args.dtype), compiled=args.compile)
    ra = result["readme_arithmetic"]
    print(
        f"{args.steps} decode steps, one layer of Llama-3.1-8B KV (B 1, Hkv 8, d 128, {result['dtype']}), "
        f"{result['threads']} threads"
    )
    base = result["rows"][1]["seconds"]
    for row in result["rows"]:
        print(
            f"  {row['system']:32s} {row['seconds']:9.3f} s  {row['bytes_copied'] / 2**30:10.4f} GiB written  "
            f"{row['seconds'] / base:8.2f}x write+advance   {1e6 * row['seconds'] / args.steps:9.1f} us/step"
        )
    print(
        f"  docs/architecture.md: {ra['kv_bytes_per_token_32_layers']:,} B of KV per token for 32 layers; concat "
        f"copies "
        f"{ra['concat_bytes_32_layers']:,} B = {ra['concat_bytes_32_layers'] / 2**40:.3f} TiB for 32 layers "
        f"(x32 the one layer above); extrapolated concat time for 32 layers: "
        f"{32 * result['rows'][0]['seconds']:.0f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
