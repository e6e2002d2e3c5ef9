"""The preallocated KV cache: allocated once, written in place, never moved.

Two halves, kept apart on purpose:

* device state (`k`, `v`, `lens`) that a captured step reads and writes with fixed shapes only;
* a host mirror of the lengths (`host_lens`) that the host validates against before anything is written and
  from which it picks the read length. Nothing in this file reads `lens` back to the host.

A step over all layers is: `validate` on the host, then on the device `write(layer, ...)` for every layer at
the old lengths, attention with `lens + n_new`, and `advance(n_new)` once; finally `commit` on the host.
`append` does all of that for a single-layer cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from static_decode.base.checks import check_int
from static_decode.base.hugepages import to_huge_pages
from static_decode.core import kv_quant

IntsLike = torch.Tensor | np.ndarray | Sequence[int]

# One spare position past max_len: the padded slots of a fixed-size chunk are all written there (a "trash"
# row no read ever covers, because reads stop at read_len <= max_len). That keeps the write a single
# fixed-shape indexed write (index_put_) with no read-modify-write, and leaves every position past a row's
# length untouched.
SPARE_ROWS = 1


def host_ints(values: IntsLike, name: str) -> np.ndarray:
    """A host int64 copy of `values`. A device tensor is read back here, so pass host values when it matters."""
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {values.dtype}")
        arr = values.detach().cpu().numpy()
    else:
        arr = np.asarray(values)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, got {arr.dtype}: {values!r}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(arr.shape)}")
    return arr.astype(np.int64)


class StaticKVCache(torch.nn.Module):
    """K and V for every layer in one allocation each, plus per-row lengths.

    `k` and `v` are [layers, B, Hkv, max_len + 1, d]: the one extra position (index `max_len`) receives the
    padded slots of fixed-size chunks and is never read. They are registered buffers, so a compiled step sees
    static addresses, and they are never reallocated: `data_ptr()` is the same for the cache's whole life.
    `lens` ([B], int64, on the cache's device) holds each row's length; `host_lens` mirrors it on the host.
    dtype int8 (core/kv_quant.py): `k`/`v` hold the codes and `k_scale`/`v_scale` ([layers, B, Hkv, max_len + 1]
    float32, allocated once beside them) their scales, written with the rows; None for a float cache.
    """

    k: torch.Tensor
    v: torch.Tensor
    lens: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        layers: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        batch = check_int("batch", batch, minimum=0)
        self.kv_heads = check_int("kv_heads", kv_heads, minimum=1)
        self.max_len = check_int("max_len", max_len, minimum=1)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.layers = check_int("layers", layers, minimum=1)
        if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or kv_quant.is_int8(dtype)):
            raise TypeError(f"dtype must be a floating torch.dtype or torch.int8, got {dtype!r}")
        shape = (self.layers, batch, self.kv_heads, self.max_len + SPARE_ROWS, self.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        for name in ("k_scale", "v_scale"):  # [layers, B, Hkv, max_len + spare]: an int8 cache's scales
            scales = torch.zeros(shape[:-1], dtype=kv_quant.SCALE_DTYPE, device=device) if self.quantized else None
            self.register_buffer(name, scales, persistent=False)
        self.register_buffer("lens", torch.zeros(batch, dtype=torch.int64, device=device), persistent=False)
        self.host_lens = np.zeros(batch, dtype=np.int64)
        # On the CPU the cache's one allocation ends on transparent huge pages, before anything is written: a decode
        # step at a long context streams the live K/V like the weights (a 4 KB page holds only a few key rows)
        to_huge_pages(self)

    # ---- shape facts -------------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def quantized(self) -> bool:
        """Whether this is an int8 cache (codes and scales; core/kv_quant.py)."""
        return kv_quant.is_int8(self.k.dtype)

    def longest(self) -> int:
        """The longest row, from the host mirror (no device read)."""
        return int(self.host_lens.max()) if self.batch else 0

    def __repr__(self) -> str:
        return (
            f"StaticKVCache(batch={self.batch}, kv_heads={self.kv_heads}, max_len={self.max_len}, "
            f"head_dim={self.head_dim}, layers={self.layers}, dtype={self.dtype}, device={self.device})"
        )

    # ---- host side: validation and the mirror ------------------------------------------------------------
    def validate(self, n_new: IntsLike, slots: int) -> np.ndarray:
        """Check a chunk of `slots` slots carrying `n_new[b]` tokens per row; return n_new on the host.

        Raises before anything is written, naming the bad row and lengths.
        """
        n = host_ints(n_new, "n_new")
        if n.shape[0] != self.batch:
            raise ValueError(f"n_new has {n.shape[0]} entries, the cache has batch {self.batch}")
        for b in range(self.batch):
            if n[b] < 0 or n[b] > slots:
                raise ValueError(f"n_new[{b}]={n[b]} must lie in 0..{slots} (the chunk has {slots} slots)")
            if self.host_lens[b] + n[b] > self.max_len:
                raise ValueError(
                    f"row {b} would overflow: it holds {self.host_lens[b]} tokens, appending {n[b]} would "
                    f"make {self.host_lens[b] + n[b]} > max_len={self.max_len}; nothing was written"
                )
        return n

    def check_kv(self, k_new: torch.Tensor, v_new: torch.Tensor) -> int:
        """Check a chunk's K/V ([B, Hkv, T, d], cache dtype and device); return T."""
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 4:
                raise ValueError(f"{name} must be [B, Hkv, T, d], got rank {x.dim()} shape {tuple(x.shape)}")
            b, h, _, d = x.shape
            if (b, h, d) != (self.batch, self.kv_heads, self.head_dim):
                raise ValueError(
                    f"{name} has shape {tuple(x.shape)}; the cache wants "
                    f"[B={self.batch}, Hkv={self.kv_heads}, T, d={self.head_dim}]"
                )
            if x.dtype != self.dtype and not (self.quantized and x.dtype.is_floating_point):
                raise TypeError(f"{name} has dtype {x.dtype}, the cache holds {self.dtype}")
            if x.device != self.device:
                raise ValueError(f"{name} is on {x.device}, the cache is on {self.device}")
        if k_new.shape != v_new.shape:
            raise ValueError(f"k_new {tuple(k_new.shape)} and v_new {tuple(v_new.shape)} differ in shape")
        return k_new.shape[2]

    def commit(self, n_new: np.ndarray) -> None:
        """Advance the host mirror by a validated n_new (the device side was advanced by `advance`)."""
        self.host_lens += n_new

    def device_ints(self, n_new: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(n_new, dtype=torch.int64).to(self.device, non_blocking=True)

    # ---- device side: fixed-shape, no host reads ---------------------------------------------------------
    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, n_new: torch.Tensor) -> None:
        """Write slot t < n_new[b] of row b at position lens[b] + t, in place; padded slots go to the spare row.

        k_new, v_new: [B, Hkv, T, d]; n_new: [B] int64 on the cache's device. Uses the *old* lengths, so call
        it for every layer before `advance`. K/V are rounded to the cache's dtype here, or quantized (int8).
        """
        _write(self.k, self.v, self.k_scale, self.v_scale, self.lens, self.max_len, layer, k_new, v_new, n_new)

    def advance(self, n_new: torch.Tensor) -> None:
        """lens += n_new on the device (once per step, after every layer is written)."""
        self.lens.add_(n_new)

    def layer_view(self, layer: int, read_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer up to read_len: views of the buffers, never copies. [B, Hkv, read_len, d]."""
        return self.k[layer, :, :, :read_len], self.v[layer, :, :, :read_len]

    def layer_scales(self, layer: int, read_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An int8 cache's K and V scales of one layer up to read_len (views, [B, Hkv, read_len]); None otherwise."""
        return _scales(self.k_scale, self.v_scale, layer, read_len)

    # ---- the single-layer convenience and housekeeping ---------------------------------------------------
    def append(self, k_new: torch.Tensor, v_new: torch.Tensor, n_new: IntsLike) -> None:
        """Append the first n_new[b] slots of k_new/v_new ([B, Hkv, T, d]) to row b (layers == 1).

        Everything is validated first; on any error the cache, `lens` and `host_lens` are untouched.
        """
        if self.layers != 1:
            raise ValueError(f"append() is for a single-layer cache; this one has {self.layers} layers")
        slots = self.check_kv(k_new, v_new)
        n = self.validate(n_new, slots)
        n_dev = self.device_ints(n)
        self.write(0, k_new, v_new, n_dev)
        self.advance(n_dev)
        self.commit(n)

    def reset(self) -> None:
        """Empty every row (lengths to zero). The storage stays where it is; stale K/V is masked."""
        self.lens.zero_()
        self.host_lens[:] = 0

    def check_read_len(self, read_len: int | None) -> int:
        """Default the read length to the longest row; refuse one that would hide keys or exceed max_len."""
        longest = self.longest()
        if read_len is None:
            return longest
        if isinstance(read_len, bool) or not isinstance(read_len, int | np.integer):
            raise TypeError(f"read_len must be a Python int, got {type(read_len).__name__}")
        if not longest <= read_len <= self.max_len:
            raise ValueError(f"read_len={read_len} must lie in {longest}..{self.max_len} (the longest row)")
        return int(read_len)


def write_slots(
    k: torch.Tensor,
    v: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
    layer: int,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    n_new: torch.Tensor,
    *,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """`StaticKVCache.write` over K/V buffers [layers, B, Hkv, max_len + spare, d] (a cache's, or a span's);
    `scales`: an int8 cache's scale buffers [layers, B, Hkv, max_len + spare], K/V then quantized into the codes."""
    B, H, T, d = k_new.shape
    dev = n_new.device
    t = torch.arange(T, device=dev)  # [T]
    pos = torch.where(t < n_new[:, None], lens[:, None] + t, max_len)  # [B, T]
    # index_put_ on the whole buffer, not scatter_ on the view k[layer]: inductor cannot reinplace a
    # mutation of a view of a graph input, so the compiled step copied the entire K/V buffer (all layers,
    # all of max_len) once per layer per step (~9x slower decode at max_len 2048; profiles/RESULTS.md,
    # "Decode benchmark"). This form is reinplaced: only the new slots are written.
    index = (
        torch.full((), layer, dtype=torch.int64, device=dev),
        torch.arange(B, device=dev)[:, None, None],  # [B, 1, 1]
        torch.arange(H, device=dev)[None, :, None],  # [1, Hkv, 1]
        pos[:, None, :],  # [B, 1, T]
    )  # broadcasts to [B, Hkv, T], the leading dims of k_new
    if scales is not None:
        kv_quant.write_int8(k, v, *scales, index, k_new, v_new)
        return
    k.index_put_(index, k_new)
    v.index_put_(index, v_new)


def _write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    lens: torch.Tensor,
    max_len: int,
    layer: int,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    n_new: torch.Tensor,
) -> None:
    """write_slots for a float cache (K/V rounded to its dtype; a no-op cast when they are in it) or an int8 one."""
    if k_scale is None or v_scale is None:
        write_slots(k, v, lens, max_len, layer, k_new.to(k.dtype), v_new.to(v.dtype), n_new)
    else:
        write_slots(k, v, lens, max_len, layer, k_new, v_new, n_new, scales=(k_scale, v_scale))


def _scales(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, layer: int, read_len: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    if k_scale is None or v_scale is None:
        return None
    return k_scale[layer, :, :, :read_len], v_scale[layer, :, :, :read_len]  # [B, Hkv, read_len] views


class LayerSpan:
    """Some consecutive layers of a cache: what one compiled region of layers reads and writes.

    k, v: [n, B, Hkv, max_len + spare, d] (views of a cache's buffers, or a region's graph inputs); lens: the
    cache's device lengths (shared, not copied). Layer j of the span is layer start + j of the cache. Only the
    device side (`write`, `layer_view`): the host mirror and `advance` stay with the cache. `scales`: an int8
    cache's K and V scales of the span's layers ([n, B, Hkv, max_len + spare] each; None for a float cache).
    """

    def __init__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        lens: torch.Tensor,
        max_len: int,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.k, self.v, self.lens, self.max_len = k, v, lens, max_len
        self.k_scale, self.v_scale = scales if scales is not None else (None, None)

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, n_new: torch.Tensor) -> None:
        """`StaticKVCache.write` for layer `layer` of the span."""
        _write(self.k, self.v, self.k_scale, self.v_scale, self.lens, self.max_len, layer, k_new, v_new, n_new)

    def layer_view(self, layer: int, read_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer `layer` of the span up to read_len: views. [B, Hkv, read_len, d]."""
        return self.k[layer, :, :, :read_len], self.v[layer, :, :, :read_len]

    def layer_scales(self, layer: int, read_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`StaticKVCache.layer_scales` for layer `layer` of the span."""
        return _scales(self.k_scale, self.v_scale, layer, read_len)
