"""The Llama-family model configuration: a validated dataclass, read from a transformers config.json.

Two config.json styles exist for the rotary embedding and both are read:

* transformers 4.x: top-level `rope_theta` plus `rope_scaling` (null, or a dict with `rope_type` or the older
  `type`, and the type's parameters);
* transformers 5.x: `rope_parameters`, one dict holding `rope_type`, `rope_theta` and the type's parameters.

Rope types "default" and "llama3" are supported; anything else is refused with an error naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from static_decode.checks import check_int

ARCHITECTURES = ("LlamaForCausalLM",)
ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _check_positive_float(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (transformers' `rope_parameters`)."""

    theta: float = 10000.0  # base wavelength: inv_freq[i] = theta ** (-2i / head_dim)
    type: str = "default"  # "default" or "llama3" (frequency-dependent scaling of Llama 3.1)
    factor: float = 1.0  # llama3: long wavelengths are divided by this
    low_freq_factor: float = 1.0  # llama3: wavelengths above original_max / low_freq_factor are scaled fully
    high_freq_factor: float = 4.0  # llama3: wavelengths below original_max / high_freq_factor are kept
    original_max_position_embeddings: int = 8192  # llama3: the context length the model was pretrained on

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {self.type!r}; supported: {', '.join(ROPE_TYPES)}")
        _check_positive_float("rope theta", self.theta)
        _check_positive_float("rope factor", self.factor)
        _check_positive_float("rope low_freq_factor", self.low_freq_factor)
        _check_positive_float("rope high_freq_factor", self.high_freq_factor)
        check_int("rope original_max_position_embeddings", self.original_max_position_embeddings, minimum=1)
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            # The smoothing divides by (high - low): equal factors would divide by zero.
            raise ValueError(
                f"llama3 rope needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama-family decoder (names follow the model, not config.json)."""

    vocab_size: int  # rows of the embedding and of the LM head
    hidden_size: int  # model width D
    intermediate_size: int  # SwiGLU inner width
    num_layers: int  # decoder blocks
    num_heads: int  # query heads Hq
    num_kv_heads: int  # key/value heads Hkv (GQA: Hq is a multiple of Hkv)
    head_dim: int = 0  # per-head width d; 0 means hidden_size // num_heads (set in __post_init__)
    rms_norm_eps: float = 1e-6  # epsilon inside every RMSNorm
    rope: RopeConfig = field(default_factory=RopeConfig)  # rotary embedding parameters
    max_position_embeddings: int = 2048  # informational: positions are computed, not looked up in a table
    tie_word_embeddings: bool = False  # LM head reuses the embedding matrix
    attention_bias: bool = False  # q/k/v/o projections carry a bias
    mlp_bias: bool = False  # gate/up/down projections carry a bias
    eos_token_ids: tuple[int, ...] = ()  # ids that end a sequence (generation_config.json or config.json)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
        ):
            check_int(name, getattr(self, name), minimum=1)
        check_int("head_dim", self.head_dim, minimum=0)
        check_int("max_position_embeddings", self.max_position_embeddings, minimum=1)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} "
                "(the GQA groups)"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                    "give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embedding rotates pairs)")
        _check_positive_float("rms_norm_eps", self.rms_norm_eps)
        if not isinstance(self.rope, RopeConfig):
            raise TypeError(f"rope must be a RopeConfig, got {type(self.rope).__name__}")
        ids = tuple(self.eos_token_ids)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise ValueError(f"eos token id {i!r} must be an int in 0..{self.vocab_size - 1}")
        object.__setattr__(self, "eos_token_ids", ids)

    @property
    def groups(self) -> int:
        """Query heads per KV head (G)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """Build from a transformers config.json dict (4.x or 5.x style); errors name the offending key."""
        archs = hf.get("architectures") or []
        if not archs or any(a not in ARCHITECTURES for a in archs):
            raise ValueError(
                f"unsupported architecture: config.json key 'architectures' is {archs!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported activation: config.json key 'hidden_act' is {act!r}; only 'silu'")
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if k not in hf]
        if missing:
            raise ValueError(f"config.json lacks required key(s): {', '.join(missing)}")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or 0,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=rope_from_hf(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            eos_token_ids=eos_ids(hf.get("eos_token_id"), "config.json key 'eos_token_id'"),
        )


def eos_ids(value: Any, where: str) -> tuple[int, ...]:
    """An EOS entry (null, int or list of ints) as a tuple; `where` names the key in errors."""
    if value is None:
        return ()
    values = value if isinstance(value, list | tuple) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{where} must be an int or a list of ints, got {value!r}")
    return tuple(values)


def rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    """Read the rotary parameters from `rope_parameters` (5.x) or `rope_theta` + `rope_scaling` (4.x)."""
    if hf.get("rope_parameters") is not None:
        params, key = dict(hf["rope_parameters"]), "rope_parameters"
        if "rope_theta" not in params and "rope_theta" in hf:
            params["rope_theta"] = hf["rope_theta"]
    else:
        params, key = dict(hf.get("rope_scaling") or {}), "rope_scaling"
        params["rope_theta"] = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    if not isinstance(params.get("rope_theta"), int | float) or isinstance(params.get("rope_theta"), bool):
        raise ValueError(f"config.json rope_theta must be a number, got {params.get('rope_theta')!r}")
    # Older 4.x files spell the type `type`; a missing type means the original RoPE.
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type: config.json key '{key}.rope_type' is {rope_type!r}; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"unsupported config.json key 'partial_rotary_factor'={partial!r}; only 1.0")
    if rope_type == "default":
        return RopeConfig(theta=float(params["rope_theta"]))
    missing = [k for k in LLAMA3_KEYS if k not in params]
    if missing:
        raise ValueError(f"llama3 rope needs config.json key(s) {', '.join(f'{key}.{k}' for k in missing)}")
    return RopeConfig(
        theta=float(params["rope_theta"]),
        type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
