"""Split-key (flash-decoding) attention: the key axis read in fixed blocks, combined by log-sum-exp.

Why: the one-call formulations hand the attention kernel B * Hkv independent work items (the kernel splits queries,
not keys). At batch 1 that is 3 items for SmolLM2-135M (2 CPU threads: one idles a third of the time) and 8 for
Llama-3.1-8B (132 streaming multiprocessors on an H200: the GPU read K/V at ~5% of its bandwidth past 1k,
profiles/RESULTS.md). Splitting the keys into blocks makes B * Hkv * (S / block) items; each block's partial
softmax comes back with its log-sum-exp, and one small combine weighs the blocks: the result is exactly softmax
attention over all keys.

How, without copying K or V (rule 1): the cache's [B, Hkv, S_alloc, d] rows merge B and Hkv into one axis and
split S into (blocks, block) as a strided view, [B*Hkv, nb, Sb, d]; the block kernel is SDPA's own fused kernel,
called through the aten op that also returns the log-sum-exp (CPU: the flash kernel; CUDA: the memory-efficient
kernel), both of which read their inputs through strides. The queries are the group folded into the query axis
(G*T rows per KV head, rule 2: no KV repeat) broadcast over the blocks (stride 0). The mask is the step's additive
[B, 1, G*T, S] bias seen per block.

Masking (rule 3): a block whose first key a slot cannot see holds no visible key for it (visibility is a prefix of
the keys), so its log-sum-exp is set to -inf before the combine (the kernels report 0 for a fully masked row, not
-inf) and it weighs exactly 0; a padded slot, every block -inf, returns exact zeros. Under a sliding window
visibility is a band, so a block is live for a slot when any of its keys is visible.

Sliding windows: a chunk of T slots through a window of W keys sees at most W + T - 1 keys per row, in at most
`window_blocks` blocks. Where the read holds more blocks than that, each row reads only its own run of them,
starting at `first_blocks` (computed on the device from the lengths), gathered into a [B*Hkv, nw, Sb, d] block
batch: the blocks wholly before every slot's window are never read, so a windowed layer's cost stops growing at W.
The run starts at a device offset, which no strided view can take without reading it back to the host, so these
blocks (at most nw * Sb keys per row and KV head, never the whole cache) are a copy; the cache is not moved.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# Keys per block. Every rung of the read ladder is a multiple of 128 (capture.buckets), so a symbolic read length
# keeps one graph; a read that is not (short test caches) is one block, i.e. plain attention plus the combine.
SPLIT_BLOCK = 128


def block_size(keys: int, block: int | None = None) -> int:
    """The block the `keys` read splits into: `block` (default SPLIT_BLOCK) when it divides the read, else the
    whole read."""
    block = SPLIT_BLOCK if block is None else block
    return block if keys % block == 0 else keys


def window_blocks(keys: int, slots: int, window: int, block: int | None = None) -> tuple[int, int]:
    """(Sb, nw): the block size of a `keys` read and how many consecutive blocks hold every key a chunk of `slots`
    slots sees through `window` (W + T - 1 keys, in at most (W + T - 2) // Sb + 2 blocks), at most all of them."""
    Sb = block_size(keys, block)
    return Sb, min(keys // Sb, (window + slots - 2) // Sb + 2)


def first_blocks(start: torch.Tensor, keys: int, slots: int, window: int, block: int | None = None) -> torch.Tensor:
    """[B] the first of each row's `window_blocks` blocks: the block of slot 0's oldest visible key (start[b] - W + 1,
    start the position of slot 0), held back so that the run ends inside the read."""
    Sb, nw = window_blocks(keys, slots, window, block)
    return ((start - window + 1).clamp(min=0) // Sb).clamp(max=keys // Sb - nw)  # [B]


def block_partials(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each block and its log-sum-exp: q [N, nb, M, d], k/v [N, nb, Sb, d] (strided views), bias
    broadcastable to [N, nb, M, Sb] -> out [N, nb, M, d], lse [N, nb, M] (float32, natural log)."""
    if q.device.type == "cuda":
        return efficient_partials(q, k, v, bias, scale, torch.ops.aten._scaled_dot_product_efficient_attention)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=bias, scale=scale
    )  # [N, nb, M, d], [N, nb, M]
    return out, lse


def efficient_partials(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, kernel: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """block_partials on CUDA through `kernel`, the memory-efficient SDPA op: it takes the bias at the full
    [N, nb, M, Sb] shape (expanded: stride 0 over the broadcast axes, no copy) and returns the log-sum-exp padded
    to a multiple of 32 query rows. Not yet run on a GPU (profiles/gpu_check times it); its logic is tested on the
    CPU with a reference kernel."""
    bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])  # [N, nb, M, Sb]
    out, lse, _, _ = kernel(q, k, v, bias, True, 0.0, False, scale=scale)  # lse [N, nb, M rounded up to 32]
    return out, lse[..., : q.shape[2]]


def split_key_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    visible: torch.Tensor,
    real: torch.Tensor,
    block: int | None = None,
    *,
    window: int | None = None,
    first_block: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, T, d]; k/v [B, Hkv, S, d] views of the cache (B and Hkv merge into one stride); the step mask's
    forms (masks.StepMask): bias [B, 1, G*T, S] additive, visible [B, T, S], real [B, T], its sliding `window`
    and, for a windowed read longer than the window's blocks, `first_block` [B] (then bias and visible cover only
    the nw blocks from first_block[b] on: `window_blocks`). Returns [B, Hq, T, d]."""
    B, Hq, T, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    M, N = G * T, B * Hkv
    Sb = block_size(S, block)
    nb = S // Sb
    kb = k.flatten(0, 1).unflatten(1, (nb, Sb))  # [N, nb, Sb, d]: a view, K read in place
    vb = v.flatten(0, 1).unflatten(1, (nb, Sb))  # [N, nb, Sb, d]
    if first_block is not None:  # only the window's run of blocks, per row (see the module docstring)
        nb = bias.shape[-1] // Sb
        run = (first_block[:, None] + torch.arange(nb, device=k.device)).repeat_interleave(Hkv, dim=0)  # [N, nb]
        rows = torch.arange(N, device=k.device)[:, None]  # [N, 1]
        kb, vb = kb[rows, run], vb[rows, run]  # [N, nb, Sb, d]: the run's blocks only
    qb = q.reshape(N, 1, M, d).expand(N, nb, M, d)  # [N, nb, M, d]: every block sees the same queries (stride 0)
    bias = bias.view(B, 1, M, nb, Sb).transpose(2, 3)  # [B, 1, nb, M, Sb]
    # Batch 1: [1, nb, M, Sb], broadcast over the KV heads. Else the rows and KV heads share one axis: a copy of
    # the bias (G*T*S per KV head), not of K/V.
    bias = bias[0] if B == 1 else bias.expand(B, Hkv, nb, M, Sb).reshape(N, nb, M, Sb)
    out, lse = block_partials(qb, kb, vb, bias, 1.0 / math.sqrt(d))  # [N, nb, M, d], [N, nb, M]
    # [B, T, nb]: a block is live for a slot iff its first key is visible (a prefix), or any key (a window's band)
    live = visible[:, :, ::Sb] if window is None else visible.unflatten(2, (nb, Sb)).any(dim=-1)
    live = live.transpose(1, 2)[:, None, :, None, :].expand(B, Hkv, nb, G, T).reshape(N, nb, M)  # [N, nb, M]
    lse = torch.where(live, lse, -math.inf)
    top = lse.amax(dim=1, keepdim=True).clamp(min=torch.finfo(lse.dtype).min)  # [N, 1, M]; finite for padded slots
    w = torch.exp(lse - top)[..., None]  # [N, nb, M, 1]: 0 for dead blocks
    zero = torch.zeros((), dtype=out.dtype, device=out.device)
    num = (torch.where(w > 0, out, zero) * w).sum(dim=1)  # [N, M, d] float32; a dead block's output never enters
    den = w.sum(dim=1).clamp(min=torch.finfo(w.dtype).tiny)  # [N, M, 1]; 0 weight (padded slot) gives 0, not NaN
    res = (num / den).to(q.dtype).view(B, Hkv, G, T, d)  # [B, Hkv, G, T, d]
    keep = real[:, None, None, :, None]  # [B, 1, 1, T, 1]
    return torch.where(keep, res, torch.zeros((), dtype=res.dtype, device=res.device)).reshape(B, Hq, T, d)
