"""Shared test helper for the rope tests: tiny transformers Llama configs and models with a given rope, transformers
fed in chunks through its own cache, and our tables for one batch-1 step."""

from __future__ import annotations

import numpy as np
import torch

from static_decode.model import rope
from static_decode.model.rope_config import RopeConfig
from tests.support.checkpoints import VOCAB

HEAD_DIM = 16  # 8 frequencies a head


def factors(n: int, seed: int, low: float, high: float) -> list[float]:
    """n longrope factors drawn in [low, high] (a fixed list per seed)."""
    return np.random.default_rng(seed).uniform(low, high, n).round(4).tolist()


def hf_config(rope_params: dict, max_positions: int, **extra):
    """A transformers LlamaConfig with this rope (4 heads of HEAD_DIM over hidden 64)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=max_positions, rope_theta=10000.0,
        rope_parameters=dict(rope_params, rope_theta=10000.0), initializer_range=0.2, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, **extra,
    )


def hf_model(rope_params: dict, max_positions: int, seed: int = 0, **extra):
    """A random transformers LlamaForCausalLM with this rope (weights large enough to spread the logits)."""
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(hf_config(rope_params, max_positions, **extra)).eval()


def hf_chunked(hf, seq: list[int], chunk: int) -> torch.Tensor:
    """[len(seq), V] float32 logits of transformers fed `seq` in chunks through its own cache: one forward call per
    chunk, so "dynamic" and "longrope" pick each chunk's table by its last position, as our steps do."""
    from transformers import DynamicCache

    cache, out = DynamicCache(config=hf.config), []
    with torch.no_grad():
        for start in range(0, len(seq), chunk):
            ids = torch.tensor([seq[start : start + chunk]])
            out.append(hf(input_ids=ids, cache=cache, use_cache=True).logits[0].float())
    return torch.cat(out)


def our_tables(config: RopeConfig, positions: torch.Tensor, head_dim: int = HEAD_DIM):
    """Our (freq, cos, sin) for one batch-1 step at positions [1, T] (the row's length after it: the last + 1)."""
    base = rope.inv_freq(config, head_dim)
    long = rope.long_inv_freq(config, head_dim) if config.type == "longrope" else None
    seq_len = positions[:, -1] + 1  # [1]
    freq = rope.step_freq(config, head_dim, base, long, seq_len)
    cos, sin = rope.cos_sin(freq, positions, torch.float32, rope.attention_factor(config))  # [1, 1, T, r/2]
    return freq, cos, sin
