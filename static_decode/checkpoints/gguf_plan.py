"""How each tensor of a GGUF file is taken into the model, decided before any data is read: Q4_0 projections of a
float32 model as our int4-g32 (the same values, and the fused decode layers take it), the other quantized types the
kernels read (static_decode.model.gguf_quant: Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) as their blocks, the
rest dequantized into the model's dtype; one line on stderr says which and why.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from static_decode.base.free_memory import free_bytes, gib
from static_decode.model.gguf_quant import BLOCK_TYPES, DTYPES
from static_decode.model.llama import Llama
from static_decode.model.parallel import TensorParallel
from static_decode.model.quant import INT4_CHUNK, Scheme

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
EMBEDDING = "token_embd.weight"


@dataclass
class Plan:
    """int4: GGUF tensors taken as int4 codes; blocks: tensor -> its block type, held as blocks; dequantized: GGUF
    type -> why its tensors are dequantized."""

    int4: set[str] = field(default_factory=set)
    blocks: dict[str, str] = field(default_factory=dict)
    dequantized: dict[str, set[str]] = field(default_factory=dict)

    def holding(self, tensor: str) -> str:
        """How `tensor` is held: "int4", its block type, or "float"."""
        return "int4" if tensor in self.int4 else self.blocks.get(tensor, "float")


def model_linears(meta: Llama, fused_projections: bool) -> list[tuple[str, ...]]:
    """Our projections' weights (names of the checkpoint layout) grouped as the model joins them: q/k/v and
    gate/up one group each when fused (one format per joined weight), the rest alone; the LM head of an untied
    model among them."""
    groups = [f"{name}.weight" for name, module in meta.named_modules() if isinstance(module, nn.Linear)]
    if not fused_projections:
        return [(g,) for g in groups]
    out: dict[str, list[str]] = {}
    for g in groups:
        head = g.replace(".k_proj.", ".q_proj.").replace(".v_proj.", ".q_proj.").replace(".up_proj.", ".gate_proj.")
        out.setdefault(head, []).append(g)
    return [tuple(v) for v in out.values()]


def mixed(groups: list[tuple[str, ...]], names: dict[str, str], plan: Plan) -> bool:
    """Whether a joined group's parts are held in several ways (a Q4_K_M file's q/k in Q4_K and v in Q6_K): one
    joined weight has one format, so such a model keeps its projections apart."""
    return any(len({plan.holding(names[w]) for w in group}) > 1 for group in groups)


def plan(groups: list[tuple[str, ...]], names: dict[str, str], tensors: dict[str, Any], dtype: torch.dtype,
         tp: TensorParallel, quantize: Scheme | None) -> Plan:
    """Which Q4_0 projections map exactly onto int4-g32 (a whole joined group or none of it), which quantized
    projections and embedding stay blocks, and why the other quantized tensors are dequantized."""
    out = Plan()
    for group in groups:
        kinds = {tensors[names[w]].tensor_type.name for w in group}
        if "Q4_0" not in kinds:
            continue
        k = int(tensors[names[group[0]]].shape[0])
        if (quantize is None and not tp.enabled and dtype == torch.float32 and k % INT4_CHUNK == 0
                and kinds == {"Q4_0"}):
            out.int4.update(names[w] for w in group)
    projections = {names[w] for group in groups for w in group} | {EMBEDDING}
    for t in tensors.values():
        kind = t.tensor_type.name
        if kind in FLOAT_TYPES or t.name in out.int4:
            continue
        why = ("quantize= asks for our own scheme" if quantize is not None
               else "tensor parallelism slices float weights" if tp.enabled
               else f"blocks multiply float32 or bfloat16 models, not {str(dtype).removeprefix('torch.')}"
               if dtype not in DTYPES
               else f"the kernels read {', '.join(BLOCK_TYPES)} blocks, not {kind}" if kind not in BLOCK_TYPES
               else f"{t.name} is not a projection" if t.name not in projections
               else None)
        if why is None:
            out.blocks[t.name] = kind
        else:
            out.dequantized.setdefault(kind, set()).add(why)
    return out


def say(file: Path, plan: Plan, dtype: torch.dtype, quantize: Scheme | None) -> None:
    """One line on stderr: which quantized tensors became int4 or stayed blocks, which were dequantized, and why."""
    if not plan.int4 and not plan.blocks and not plan.dequantized:
        return
    parts = [f"{len(plan.int4)} Q4_0 tensor(s) as int4-g32 (exact)"] if plan.int4 else []
    kinds = sorted(set(plan.blocks.values()))
    if kinds:
        counts = ", ".join(f"{sum(k == kind for k in plan.blocks.values())} {kind}" for kind in kinds)
        parts.append(f"{counts} tensor(s) kept as their blocks (exact)")
    parts += [f"{kind} dequantized to {str(dtype).removeprefix('torch.')} ({'; '.join(sorted(why))})"
              for kind, why in plan.dequantized.items()]
    tail = f"; then quantized as {quantize.name}" if quantize is not None else ""
    print(f"{file.name}: {'; '.join(parts)}{tail}", file=sys.stderr)


def model_bytes(plan: Plan, tensors: dict[str, Any], dtype: torch.dtype) -> int:
    """Bytes the model's tensors take once loaded: blocks as stored, int4 codes and float32 scales, every other
    tensor (float or dequantized) in `dtype`."""
    total = 0
    for t in tensors.values():
        if t.name in plan.blocks:
            total += int(t.n_bytes)
        elif t.name in plan.int4:
            total += int(t.n_elements) // 2 + int(t.n_elements) // 32 * 8
        else:
            total += int(t.n_elements) * dtype.itemsize
    return total


def check_fits(file: Path, plan: Plan, tensors: dict[str, Any], dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, before any tensor is read, a model that would not fit in what `device` has free, naming the bytes
    and what dequantizing costs."""
    need, free = model_bytes(plan, tensors, dtype), free_bytes(device)
    if free is None or need <= free:
        return
    floats = sum(int(t.n_elements) * dtype.itemsize for t in tensors.values()
                 if t.tensor_type.name not in FLOAT_TYPES and t.name not in plan.blocks and t.name not in plan.int4)
    why = (f", {gib(floats)} of it quantized tensors dequantized to {str(dtype).removeprefix('torch.')}"
           f" ({'; '.join(sorted({w for ws in plan.dequantized.values() for w in ws}))})" if floats else "")
    raise ValueError(f"{file.name}: the model needs {gib(need)}{why}; {device} has {gib(free)} free")
