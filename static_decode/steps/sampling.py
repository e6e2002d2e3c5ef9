"""Token choice on the device: greedy, or sampling by the exponential race, with per-row parameters.

Sampling is argmax_v p_v / E_v with E_v ~ Exp(1) drawn from a counter-based hash of (seed, step, token id): no
torch.Generator and no host sync in the step, the same draw eager or compiled, whatever the batch, and a fixed
seed reproduces the tokens. Per row, in vLLM's order: logit bias, repetition penalty, presence and frequency
penalties (on the logits, greedy rows too), then temperature (0 = greedy), min-p, top-k, top-p. The seen and
counted tokens are device tensors, so nothing is read back. The orders and definitions: docs/internals.md#sampling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from static_decode.kernels import cpu_kernel

MASK32 = 0xFFFFFFFF
# lowbias32 (C. Wellons' hash-prospector): a 32-bit mixer with good avalanche. Both constants are split into
# 16-bit halves for the multiply, so every product stays below 2**48 in int64.
MIX_A, MIX_B = 0x7FEB352D, 0x846CA68B
SEED_SALT = 0x9E3779B9  # golden-ratio constant: separates the two keys derived from one (seed, step)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for 0 <= x < 2**32, without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer mixer on int64 tensors holding values in 0..2**32-1."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_A)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_B)
    return x ^ (x >> 16)


def mix32_host(x: int) -> int:
    """mix32 on a Python int (host side, e.g. to derive per-row seeds)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * MIX_A) & MASK32
    x ^= x >> 15
    x = (x * MIX_B) & MASK32
    return x ^ (x >> 16)


def row_seed(seed: int, row: int) -> int:
    """The 32-bit seed of one batch row: rows of one request draw independently; row 0 of a batch draws
    exactly what a single request with the same seed draws."""
    s = mix32_host(seed ^ mix32_host(seed >> 32))
    return s if row == 0 else mix32_host(s ^ mix32_host(row))


def _stored(x: torch.Tensor) -> torch.Tensor:
    """x itself, as an identity view that inductor must write to a buffer. Every xor-shift reads its input
    twice, so inductor, inlining pointwise producers, expands nested mixers exponentially: storing each
    mixer's output keeps the sampled steps' compile time near the greedy ones' (docs/internals.md#sampling)."""
    return torch.as_strided(x, x.shape, x.stride())


def uniform(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] float32 uniforms in (0, 1) hashed from (seed[b], step[b], v); seed [B] int64 < 2**32, step [] or
    [B] int64 (each row's own counter)."""
    v = torch.arange(vocab, device=seed.device, dtype=torch.int64)  # [V]
    key = _stored(mix32(_stored(seed) ^ (step & MASK32)))  # [B] (the seed may itself be a mixer's output)
    key2 = _stored(mix32(key ^ SEED_SALT))  # [B]
    h = _stored(mix32(_stored(mix32(v[None, :] ^ key[:, None])) ^ key2[:, None]))  # [B, V], two keyed rounds
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # 24 bits: exact in float32, never 0 or 1


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with row b's seen tokens (seen [B, V] bool) penalised by penalty[b] ([B] float32; 1 = off):
    divided when positive, multiplied when not. Float32 out (the input's values exactly where nothing changes)."""
    logits = logits.to(torch.float32)
    p = penalty[:, None]  # [B, 1]
    hit = torch.where(logits > 0, logits / p, logits * p)  # [B, V]
    return torch.where(seen, hit, logits)


def bias(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """logits [B, V] plus values[b, j] at token ids[b, j] (ids, values [B, M]; an unused entry is id 0 with value
    0, which adds nothing). Float32 out (the input's values exactly where no entry adds anything)."""
    return logits.to(torch.float32).scatter_add(1, ids, values)  # [B, V]


def penalize_counts(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """logits [B, V] less presence[b] * (counts[b, t] > 0) + frequency[b] * counts[b, t] (OpenAI's presence and
    frequency penalties; counts [B, V] of row b's emitted tokens, presence / frequency [B] float32, 0 = off).
    Float32 out (the input's values exactly where both are 0)."""
    c = counts.to(torch.float32)  # [B, V]
    return logits.to(torch.float32) - presence[:, None] * (c > 0) - frequency[:, None] * c  # [B, V]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[B] argmax token ids (the first on ties, as torch.argmax and transformers' greedy search)."""
    return logits.argmax(dim=-1)


BITS_ABOVE_INF = 0x7F800001  # one past +inf's float32 bit pattern: every order key is below it
SEARCH_STEPS = 31  # halvings of [0, BITS_ABOVE_INF): the search ends at one bit pattern


def _order_keys(scaled: torch.Tensor) -> torch.Tensor:
    """[B, V] int32 keys that sort the scaled logits (all <= 0, -inf where cut) best first: the bit pattern of
    |scaled| (= -scaled, but +0 for the best token's 0, whose negation -0 has the sign bit set), which for float32
    values >= 0 (+inf included) orders as the values do."""
    return scaled.abs().view(torch.int32)


def _largest_key(ok: Callable[[torch.Tensor], torch.Tensor], rows: int, device: torch.device) -> torch.Tensor:
    """[B] int32: per row the largest key b in [0, BITS_ABOVE_INF) with ok(b) true, for ok([B] int32) -> [B] bool
    true at 0 and monotone (true up to some key, false past it): a fixed-length bisection, no sort and no host
    read, exact because it halves the integer range of the keys."""
    lo = torch.zeros(rows, dtype=torch.int32, device=device)  # ok(lo) holds
    hi = torch.full((rows,), BITS_ABOVE_INF, dtype=torch.int32, device=device)  # ok(hi) fails (or is past the end)
    for _ in range(SEARCH_STEPS):
        mid = lo + (hi - lo) // 2  # [B]
        good = ok(mid)  # [B]
        # stored: else each step's kernel would recompute every earlier step's bounds for every vector it reads
        lo, hi = _stored(torch.where(good, mid, lo)), _stored(torch.where(good, hi, mid))
    return lo


def _kept(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The filter both `sample` and `probabilities` apply, in the module's order (temperature, min-p, top-k,
    top-p): the scaled logits in vocabulary order with the tokens below min-p, past top-k and past top-p at -inf
    [B, V], and which rows sample (temperature > 0) [B]. min_p None: off.

    No sort: top-k keeps the tokens whose order key is at most the k-th smallest, top-p those whose more probable
    tokens hold less than top_p of the mass, each threshold found by `_largest_key` (on the CPU with the kernels
    built: by csrc/sample_keys.cpp's ops, the same thresholds in three passes over the row). Tokens tied at a threshold
    are kept together (a sort would keep some of them by position)."""
    logits = logits.to(torch.float32)
    B = logits.shape[0]
    hot = temperature > 0  # [B]
    # The row's best logit subtracted first: a tiny temperature sends the others to -inf, never past float32's
    # range to inf - inf = NaN, so T -> 0 gives exactly its limit, the argmax (ties drawn evenly).
    top = logits.amax(dim=-1, keepdim=True)  # [B, 1]
    scaled = (logits - top) / torch.where(hot, temperature, 1.0)[:, None]  # [B, V], <= 0, the best at 0
    if min_p is not None:
        # vLLM's min-p: probability below min_p times the top token's after temperature (the best has p / top = 1,
        # so it always stays).
        scaled = scaled.masked_fill(scaled.exp() < min_p[:, None], -torch.inf)  # p / p_top = exp(scaled)
    # every search step reads the keys and probabilities: stored once, not recomputed in each step's kernel
    keys = _stored(_order_keys(scaled))  # [B, V]
    k = top_k.to(torch.int64)[:, None]  # [B, 1]
    # the k-th best key: the smallest key b with at least k tokens at or before it, i.e. one past the largest b
    # with fewer than k before it
    # (counted in int32: V < 2**31, and inductor's int32 sum vectorizes where an int64 one is ~2x slower)
    native = logits.device.type == "cpu" and cpu_kernel.available()  # a constant when a step is traced
    if native:  # the same threshold in three passes over the row (csrc/sample_keys.cpp)
        below_k = torch.ops.static_decode_cpu.top_k_key(keys, k[:, 0])  # [B]
    else:
        below_k = _largest_key(lambda b: (keys < b[:, None]).sum(dim=-1, dtype=torch.int32) < k[:, 0], B,
                               logits.device)  # [B]
    scaled = _stored(scaled.masked_fill((k > 0) & (keys > below_k[:, None]), -torch.inf))  # [B, V]
    keys = _stored(_order_keys(scaled))  # [B, V]
    probs = _stored(scaled.softmax(dim=-1))  # [B, V]
    # Keep a token while the tokens strictly more probable than it hold less than top_p of the mass. The best
    # token is never dropped (mass before it is 0 < top_p).
    p = top_p[:, None]  # [B, 1]
    if native:
        last = torch.ops.static_decode_cpu.top_p_key(keys, probs, p[:, 0].to(torch.float32))  # [B]
    else:
        last = _largest_key(lambda b: (probs * (keys < b[:, None])).sum(dim=-1) < p[:, 0], B, logits.device)  # [B]
    return scaled.masked_fill((p < 1) & (keys > last[:, None]), -torch.inf), hot


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B] token ids from logits [B, V]; per-row temperature/top_k/top_p/seed [B]; step [] or [B] int64 (device);
    min_p [B] float32 (0 = off; None: no min-p filter at all).

    Fixed shapes, no host reads. Rows with temperature 0 take the argmax.
    """
    kept, hot = _kept(logits, temperature, top_k, top_p, min_p)  # [B, V], [B]
    noise = uniform(seed, step, logits.shape[-1])  # [B, V] the draw of each token id
    score = kept - torch.log(-torch.log(noise))  # logits/T - log E, E = -log U ~ Exp(1)
    return torch.where(hot, score.argmax(dim=-1), greedy(logits))


def probabilities(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, V] float32: the distribution `sample` draws from (temperature, then min-p, top-k and top-p,
    renormalised), in vocabulary order. Rows with temperature 0 get the one-hot of their argmax (what `sample`
    returns there). Speculative sampling needs the distribution itself, not a draw: it accepts a draft token with
    probability p(token) / q(token) and otherwise draws from the residual max(0, p - q)."""
    kept, hot = _kept(logits, temperature, top_k, top_p, min_p)  # [B, V], [B]
    onehot = F.one_hot(greedy(logits), logits.shape[-1]).to(torch.float32)  # [B, V]
    return torch.where(hot[:, None], kept.softmax(dim=-1), onehot)


def draw(probs: torch.Tensor, seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """[B] ids drawn from the rows of probs [B, V] (unnormalised is fine; zeros are never drawn) by the
    exponential race keyed by (seed[b], step[b]). An all-zero row returns id 0."""
    noise = uniform(seed, step, probs.shape[-1])  # [B, V]
    return (torch.log(probs) - torch.log(-torch.log(noise))).argmax(dim=-1)
