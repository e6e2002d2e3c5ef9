"""Tensor parallelism (Megatron-style): which slice of each weight a rank holds, and the one collective.

Rank r of `world` holds the r-th contiguous slice: q/k/v and gate/up split by output features (whole GQA groups per
rank, so each rank's cache holds only its KV heads), o and down by input features with one all-reduce after each,
everything else replicated. The LM head is replicated on purpose: every rank then samples the same token with no
collective inside the step. A rank reads the checkpoint's parts by their own slices and joins them (a joined weight
is never sliced). The all-reduce is functional, so a compiled step keeps it in its graph. The layout in full:
docs/internals.md#parallel.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass
from typing import Any

import torch

from static_decode.model.config import LlamaConfig

# Parameter-name suffixes by the weight dimension split across ranks (everything else is replicated).
COLUMN_PARALLEL = (
    "q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
    "gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias",
    # Joined (see the module doc): dim 0 holds world slices' worth of rows, but never a slice of the joined matrix.
    "qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight", "gate_up_proj.bias",
)  # fmt: skip
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


def shard_dim(name: str) -> int | None:
    """The dimension of parameter `name` split across ranks (0 or 1), or None when it is replicated."""
    last = ".".join(name.rsplit(".", 2)[-2:])  # "<linear>.<weight|bias>": "qkv_proj.weight" is not "v_proj.weight"
    if last in COLUMN_PARALLEL:
        return 0
    if last in ROW_PARALLEL:
        return 1
    return None


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: rank r of `world`.

    `group` is the torch.distributed process group the all-reduces run over (None: the default group). A
    TensorParallel with world > 1 can be built without an initialised group (to load a rank's shard, or to
    check a layout); running a step needs the group.
    """

    rank: int = 0  # this process's index in the group, 0..world-1
    world: int = 1  # ranks sharing one model (1 = no tensor parallelism)
    group: Any = None  # torch.distributed ProcessGroup; None = the default (WORLD) group

    def __post_init__(self) -> None:
        for name in ("rank", "world"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"tensor-parallel {name} must be an int, got {type(value).__name__} {value!r}")
        if self.world < 1:
            raise ValueError(f"tensor-parallel world size must be >= 1, got {self.world}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"tensor-parallel rank must lie in 0..{self.world - 1}, got {self.rank}")

    @classmethod
    def current(cls) -> TensorParallel:
        """The default process group's rank and size when torch.distributed is initialised, else world 1."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(rank=dist.get_rank(), world=dist.get_world_size())
        return cls()

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def check(self, config: LlamaConfig) -> None:
        """Refuse a world size that does not split the model into whole KV heads / GQA groups and MLP slices."""
        if config.num_kv_heads % self.world:
            raise ValueError(
                f"tensor-parallel world size {self.world} does not divide num_kv_heads={config.num_kv_heads}: "
                f"each rank must hold whole KV heads with their {config.groups} query heads each; use a world "
                f"size among {divisors(config.num_kv_heads)}"
            )
        if config.intermediate_size % self.world:
            raise ValueError(
                f"tensor-parallel world size {self.world} does not divide intermediate_size="
                f"{config.intermediate_size} (the MLP is split by its inner width)"
            )

    def require_group(self) -> None:
        """Refuse to run a shard's step without the process group its all-reduces need (world 1: nothing)."""
        if self.world == 1:
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"this model is the shard of tensor-parallel rank {self.rank} of {self.world}, but torch.distributed "
                "is not initialised: launch with torchrun and call torch.distributed.init_process_group first"
            )
        size = dist.get_world_size(self.group)
        if size != self.world:
            raise RuntimeError(f"the process group has {size} ranks, this shard was built for {self.world}")

    def span(self, total: int) -> tuple[int, int]:
        """[start, stop) of this rank's contiguous slice of `total` (a multiple of world)."""
        if total % self.world:
            raise ValueError(f"{total} does not split evenly over {self.world} tensor-parallel ranks")
        size = total // self.world
        return self.rank * size, (self.rank + 1) * size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (identity at world 1): a functional collective torch.compile traces."""
        if self.world == 1:
            return x
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        group = self.group if self.group is not None else dist.group.WORLD
        if torch.compiler.is_compiling():
            return funcol.all_reduce(x, "sum", group)
        # Eager: the same functional op and its wait, without funcol's AsyncCollectiveTensor wrapper. That wrapper
        # keeps the process group alive past destroy_process_group (torch 2.13), so gloo's worker threads outlive
        # it into the interpreter's teardown, where one still dropping a collective's tensor takes the GIL and
        # aborts the process ("terminate called without an active exception", ~1 run in 12 on a loaded host).
        out = torch.ops._c10d_functional.all_reduce(x, "sum", group.group_name)  # same shape as x
        return torch.ops._c10d_functional.wait_tensor(out)

    def backend(self) -> str | None:
        """The collectives backend ("nccl", "gloo", ...) of the group; None at world 1."""
        if self.world == 1:
            return None
        import torch.distributed as dist

        return str(dist.get_backend(self.group))

    def shared_random_bits(self, bits: int = 64) -> int:
        """A random int every rank agrees on: drawn on group rank 0 and broadcast (world 1: drawn here).

        Sampling without a seed must use the same seed on every rank: the all-reduced logits are identical, so
        the same noise picks the same tokens, the ranks stop at EOS together and their collectives stay matched.
        One host broadcast per request, outside every step."""
        return int(self.from_rank0(random.getrandbits(bits)))

    def from_rank0(self, value: Any) -> Any:
        """Group rank 0's `value` on every rank (a picklable host object; world 1: `value` itself). For host
        decisions every rank must share: a sampling seed, a line of user input read on rank 0 only."""
        if self.world == 1:
            return value
        self.require_group()
        import torch.distributed as dist

        box = [value]
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def describe(self) -> str:
        return f"tensor-parallel rank {self.rank} of {self.world}" if self.enabled else "single process"


SINGLE = TensorParallel()


def joined_rows(parts: tuple[int, ...], tp: TensorParallel) -> list[tuple[int, int]]:
    """[start, stop) rows of this rank's slice of each part of a weight stored joined by rows (Phi3's qkv_proj: q,
    k, v; gate_up_proj: gate, up), in the joined tensor's row numbers: a rank's joined weight stacks them."""
    spans, offset = [], 0
    for rows in parts:
        start, stop = tp.span(rows)
        spans.append((offset + start, offset + stop))
        offset += rows
    return spans


def divisors(n: int) -> list[int]:
    return [w for w in range(1, n + 1) if n % w == 0]


def open_group(backend: str, rank: int, world: int, init_method: str | None = None) -> None:
    """`torch.distributed.init_process_group`, with torch._dynamo and the functional collectives imported first:
    imported after it, they keep the group alive past destroy_process_group (torch 2.13), so its gloo worker threads
    live on into the interpreter's teardown, where one releasing a collective's tensor takes the GIL and aborts the
    process ("terminate called without an active exception")."""
    import torch.distributed as dist

    for name in ("torch._dynamo", "torch.distributed._functional_collectives"):
        importlib.import_module(name)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
