"""Gemma 2 and Gemma 3 (text) config.json keys, read as transformers' Gemma2Config / Gemma3TextConfig read them,
onto LlamaConfig's switches (static_decode.model.config).

What Gemma adds to the Llama decoder: (1 + weight) RMSNorms computed in float32, four of them a layer (input,
post-attention, pre- and post-feedforward), embeddings scaled by sqrt(hidden_size), a gelu-tanh gated MLP
(`hidden_activation`), scores scaled by `query_pre_attn_scalar` ** -0.5, sliding and full layers interleaved by
`layer_types` (defaults: Gemma 2 alternates, sliding first; Gemma 3 slides five layers in six,
`sliding_window_pattern`), Gemma 2's tanh softcapping of the attention scores and of the logits, Gemma 3's q/k norms
and its two rotary embeddings (the full layers' `rope_parameters.full_attention`, 4.x `rope_theta` + `rope_scaling`,
default theta 1e6; the sliding layers' `rope_parameters.sliding_attention`, 4.x `rope_local_base_freq`, default 1e4).
"""

from __future__ import annotations

from typing import Any

from static_decode.model.rope_config import RopeConfig, rope_from_hf

GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # the MLP gate activations the model computes
LAYER_KINDS = ("full_attention", "sliding_attention")
# transformers' defaults where a config.json leaves a key out: (Gemma2Config, Gemma3TextConfig).
DEFAULTS: dict[str, tuple[Any, Any]] = {
    "head_dim": (256, 256),
    "query_pre_attn_scalar": (256, 256),
    "sliding_window": (4096, 4096),
    "final_logit_softcapping": (30.0, None),
    "attn_logit_softcapping": (50.0, None),
    "max_position_embeddings": (8192, 131072),
}
GLOBAL_THETA, LOCAL_THETA = 1e6, 1e4  # Gemma3TextConfig.default_theta


def _get(arch: str, hf: dict[str, Any], key: str) -> Any:
    return hf[key] if key in hf else DEFAULTS[key][GEMMA.index(arch)]


def _bool(hf: dict[str, Any], key: str, default: bool) -> bool:
    value = hf.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config.json key {key!r} must be true or false, got {value!r}")
    return value


def _layer_types(arch: str, hf: dict[str, Any], layers: Any) -> list[str]:
    types = hf.get("layer_types")
    if types is None:
        every = 2 if arch == "Gemma2ForCausalLM" else hf.get("sliding_window_pattern", 6)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"config.json key 'sliding_window_pattern' must be an int >= 1, got {every!r}")
        return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_KINDS for t in types):
        raise ValueError(
            f"unsupported config.json key 'layer_types' {types!r}: {layers} entries (one a layer), each one of "
            f"{', '.join(LAYER_KINDS)}"
        )
    return types


def _ropes(arch: str, hf: dict[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """(the full layers' rope, the sliding layers' rope or None where they share it: Gemma 2)."""
    if arch == "Gemma2ForCausalLM":
        return rope_from_hf(hf), None
    base = {"max_position_embeddings": _get(arch, hf, "max_position_embeddings")}
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and set(params) & set(LAYER_KINDS):  # 5.x: one rope dict per layer kind
        unknown = sorted(set(params) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(f"unsupported config.json key 'rope_parameters.{unknown[0]}' (Gemma 3 reads "
                             f"{', '.join(LAYER_KINDS)})")
        full = rope_from_hf({**base, "rope_theta": GLOBAL_THETA, "rope_parameters": params.get("full_attention")})
        local = {**base, "rope_theta": LOCAL_THETA, "rope_parameters": params.get("sliding_attention")}
        return full, rope_from_hf(local)
    full = rope_from_hf({**hf, "rope_theta": hf.get("rope_theta", GLOBAL_THETA)})  # 4.x: rope_scaling is the full's
    return full, rope_from_hf({**base, "rope_theta": hf.get("rope_local_base_freq", LOCAL_THETA)})


def gemma_switches(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """LlamaConfig's keyword arguments (all but the EOS ids) for a Gemma 2 / Gemma 3 config.json dict."""
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks required key(s): {', '.join(missing)}")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported activation: config.json key 'hidden_activation' is {act!r}; only "
                         "'gelu_pytorch_tanh' for Gemma")
    if _bool(hf, "use_bidirectional_attention", False):
        raise ValueError("unsupported config.json key 'use_bidirectional_attention': true (an encoder, not a "
                         "causal LM)")
    layers = hf["num_hidden_layers"]
    window = _get(arch, hf, "sliding_window")
    types = _layer_types(arch, hf, layers)
    sliding = tuple(t == "sliding_attention" for t in types)
    if any(sliding) and window is None:
        raise ValueError("config.json key 'sliding_window' is null, but 'layer_types' names sliding layers")
    scalar = _get(arch, hf, "query_pre_attn_scalar")
    if isinstance(scalar, bool) or not isinstance(scalar, int | float) or scalar <= 0:
        raise ValueError(f"config.json key 'query_pre_attn_scalar' must be a positive number, got {scalar!r}")
    rope, local_rope = _ropes(arch, hf)
    bias = _bool(hf, "attention_bias", False)
    return {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_layers": layers,
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "head_dim": _get(arch, hf, "head_dim"),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope": rope,
        "local_rope": local_rope,
        "max_position_embeddings": _get(arch, hf, "max_position_embeddings"),
        "tie_word_embeddings": _bool(hf, "tie_word_embeddings", True),
        "qkv_bias": bias,
        "o_bias": bias,
        "qk_norm": arch == "Gemma3ForCausalLM",
        "sliding_window": window if any(sliding) else None,
        "sliding_layers": sliding if any(sliding) else None,
        "hidden_act": act,
        "norm_plus_one": True,
        "sandwich_norms": True,
        "embed_scale": True,
        "query_scale": float(scalar) ** -0.5,
        "attn_softcap": _get(arch, hf, "attn_logit_softcapping"),
        "final_softcap": _get(arch, hf, "final_logit_softcapping"),
        "architecture": arch,
    }
