"""Joined projections: q/k/v, and gate/up, one nn.Linear each, with the checkpoint's names kept.

A one-row decode step multiplies one row by each weight: a GEMV bound by reading it, plus a fixed cost per call
(a dispatch; on CUDA a kernel launch and a tail where few blocks are left). q, k and v read the same row, as do
gate and up, so each group is one nn.Linear whose weight is the checkpoint's matrices stacked by rows, joined
once at load: 4 products a layer instead of 7. The checkpoint keeps its own names: `state_dict()` gives the parts
(row-block views of the joined weight) and `load_state_dict` takes them and joins them (`join_projections`).
Under tensor parallelism a rank's joined weight stacks its own q, k and v slices (its heads), which is not a
slice of the whole joined matrix: loading reads the parts' slices and joins those. The joined weight is a plain
nn.Linear's, so anything that rewrites linears (quantisation) treats it as one.
"""

from __future__ import annotations

import torch
from torch import nn

Joined = dict[str, tuple[tuple[str, ...], tuple[int, ...]]]  # joined linear -> (parts in row order, their rows)


def checkpoint_layout(module: nn.Module, joined: Joined) -> None:
    """Make `module`'s state dict speak the checkpoint's names: its joined linears split into their parts on
    `state_dict()`, the parts joined on `load_state_dict()`."""
    module.joined = joined
    module.register_state_dict_post_hook(_split_state)
    module.register_load_state_dict_pre_hook(_join_state)


def _split_state(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    for name, (parts, rows) in module.joined.items():
        for suffix in (".weight", ".bias"):
            whole = state.pop(prefix + name + suffix, None)
            if whole is None:
                continue
            for part, piece in zip(parts, whole.split(rows), strict=True):  # row blocks: views, no copy
                state[prefix + part + suffix] = piece


def _join(state: dict, prefix: str, joined: Joined) -> list[str]:
    """Join the parts found in `state`; return the parts missing where only some were found."""
    missing = []
    for name, (parts, _) in joined.items():
        for suffix in (".weight", ".bias"):
            keys = [prefix + part + suffix for part in parts]
            if all(k in state for k in keys):
                state[prefix + name + suffix] = torch.cat([state.pop(k) for k in keys])  # [sum(rows), ...]
            elif any(k in state for k in keys):
                missing += [k for k in keys if k not in state]
    return missing


def _join_state(
    module: nn.Module, state: dict, prefix: str, local_metadata: dict, strict: bool, missing_keys: list, *_: object
) -> None:
    missing_keys += _join(state, prefix, module.joined)  # named by the checkpoint's keys in the error


def join_projections(model: nn.Module, state: dict) -> None:
    """Join, in place, the checkpoint-named parts in `state` (a state dict of `model`'s, by our parameter names)
    into `model`'s joined projections, popping each layer's parts as it goes (loading: at most one layer's joined
    weights exist twice at once)."""
    for name, module in model.named_modules():
        if getattr(module, "joined", None):
            _join(state, f"{name}." if name else "", module.joined)
