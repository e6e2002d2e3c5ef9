"""The Llama-family model configuration: a validated dataclass, read from a transformers config.json.

One decoder covers several transformers architectures (Llama, Mistral, Qwen2, Qwen3, Phi3; Gemma 2 and 3 read by
static_decode.model.gemma_config); what differs between them is a
handful of switches that `LlamaConfig.from_hf` maps each architecture's config.json keys onto: biases, Qwen3's q/k
norms, an explicit head_dim, per-layer sliding windows (a mask, not a bound on the cache). Both transformers rope
spellings are read (static_decode.model.rope_config). Per family: docs/internals.md#config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from static_decode.base.checks import check_int, is_number
from static_decode.model.gemma_config import GEMMA, HIDDEN_ACTS, gemma_switches
from static_decode.model.rope_config import RopeConfig, rope_from_hf

ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM", *GEMMA,
)
JOINED_ON_DISK = ("Phi3ForCausalLM",)  # checkpoints that store q/k/v and gate/up joined (qkv_proj, gate_up_proj)
# transformers' layer kinds (Qwen2/Qwen3 `layer_types`): which layers attend through a sliding window.
LAYER_TYPES = ("full_attention", "sliding_attention")
QWEN3_DEFAULT_HEAD_DIM = 128  # Qwen3Config's default: a config.json without head_dim means 128


def _check_positive_float(name: str, value: Any) -> None:
    if (
        not is_number(value)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


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
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2; Llama and Qwen3 with attention_bias)
    o_bias: bool = False  # o_proj carries a bias (Llama and Qwen3 with attention_bias; never Qwen2)
    mlp_bias: bool = False  # gate/up/down projections carry a bias (Llama with mlp_bias)
    qk_norm: bool = False  # RMSNorm over head_dim on every q and k head, before the rotary embedding (Qwen3)
    sliding_window: int | None = None  # keys a query sees on the sliding layers; None: full causal attention
    # Which layers slide (Qwen2/Qwen3's layer_types or max_window_layers), one bool a layer; None: every layer does
    # when sliding_window is set.
    sliding_layers: tuple[bool, ...] | None = None
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)
    norm_plus_one: bool = False  # Gemma: every RMSNorm scales by (1 + weight), in float32 before the cast back
    sandwich_norms: bool = False  # Gemma 2/3: norms on the attention and MLP outputs and before the MLP (4 a layer)
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size), rounded to the model dtype
    query_scale: float | None = None  # the scores' scale (Gemma: query_pre_attn_scalar ** -0.5); None: head_dim**-0.5
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap) before the mask and softmax
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    local_rope: RopeConfig | None = None  # Gemma 3: the sliding layers' own rotary embedding; None: `rope` everywhere
    architecture: str = "LlamaForCausalLM"  # the transformers class this config was read for (informational)
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
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, minimum=1)
        if self.sliding_layers is not None:
            layers = tuple(self.sliding_layers) if isinstance(self.sliding_layers, list | tuple) else None
            if layers is None or len(layers) != self.num_layers or not all(isinstance(x, bool) for x in layers):
                raise ValueError(
                    f"sliding_layers must be None or {self.num_layers} bools (one a layer), got {self.sliding_layers!r}"
                )
            if self.sliding_window is None:
                raise ValueError("sliding_layers names sliding layers but sliding_window is None")
            object.__setattr__(self, "sliding_layers", layers)
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not one of {', '.join(ARCHITECTURES)}")
        if not isinstance(self.rope, RopeConfig):
            raise TypeError(f"rope must be a RopeConfig, got {type(self.rope).__name__}")
        self.rope.check(self.head_dim)
        if self.local_rope is not None:
            if not isinstance(self.local_rope, RopeConfig):
                raise TypeError(f"local_rope must be a RopeConfig or None, got {type(self.local_rope).__name__}")
            self.local_rope.check(self.head_dim)
            if self.local_rope.rotary_dim(self.head_dim) != self.rope.rotary_dim(self.head_dim):
                raise ValueError("local_rope must rotate as many dims of a head as rope")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {', '.join(HIDDEN_ACTS)}, got {self.hidden_act!r}")
        for name in ("norm_plus_one", "sandwich_norms", "embed_scale"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("query_scale", "attn_softcap", "final_softcap"):
            if getattr(self, name) is not None:
                _check_positive_float(name, getattr(self, name))
        ids = tuple(self.eos_token_ids)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise ValueError(f"eos token id {i!r} must be an int in 0..{self.vocab_size - 1}")
        object.__setattr__(self, "eos_token_ids", ids)

    @property
    def joined_checkpoint(self) -> bool:
        """Whether the checkpoint stores q/k/v and gate/up joined (Phi3's qkv_proj, gate_up_proj): the model then
        keeps those joined linears under those names (static_decode.model.joining)."""
        return self.architecture in JOINED_ON_DISK

    def layer_rope(self, layer: int) -> int | None:
        """Which rotary table layer `layer` takes: None where the model has one (`rope`), else 0 (`rope`, the full
        layers) or 1 (`local_rope`, the sliding layers)."""
        if self.local_rope is None:
            return None
        return 0 if self.layer_window(layer) is None else 1

    @property
    def groups(self) -> int:
        """Query heads per KV head (G)."""
        return self.num_heads // self.num_kv_heads

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (None: it attends every earlier key)."""
        check_int("layer", layer, minimum=0)
        if layer >= self.num_layers:
            raise ValueError(f"layer={layer} must be below num_layers={self.num_layers}")
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Every layer's sliding window, in order (None where a layer attends every earlier key)."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    def check_max_len(self, max_len: int) -> None:
        """Check a cache length before anything is allocated: any int >= 1. A sliding window is the attention's
        mask (each windowed layer sees the last sliding_window keys), not a bound on the cache, so every length
        is exact."""
        check_int("max_len", max_len, minimum=1)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """Build from a transformers config.json dict (4.x or 5.x style); errors name the offending key."""
        archs = hf.get("architectures") or []
        if not isinstance(archs, list) or len(set(archs)) != 1 or archs[0] not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture: config.json key 'architectures' is {archs!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        arch = archs[0]
        if arch in GEMMA:
            eos = eos_ids(hf.get("eos_token_id"), "config.json key 'eos_token_id'")
            return cls(**gemma_switches(arch, hf), eos_token_ids=eos)
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
        rope = rope_from_hf(_phi3_rope_names(hf) if arch == "Phi3ForCausalLM" else hf)
        if rope.partial_rotary_factor != 1.0 and arch != "Phi3ForCausalLM":
            # transformers' classes for these architectures rotate every dim of a head whatever the key says
            # (default rope) or fail (scaled rope): the key cannot describe one of their checkpoints.
            raise ValueError(
                f"unsupported config.json key 'partial_rotary_factor'={rope.partial_rotary_factor!r}: transformers' "
                f"{arch} rotates whole heads; only 1.0 loads for it"
            )
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or (QWEN3_DEFAULT_HEAD_DIM if arch == "Qwen3ForCausalLM" else 0),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=_flag(hf, "tie_word_embeddings"),
            **_family_switches(arch, hf),
            architecture=arch,
            eos_token_ids=eos_ids(hf.get("eos_token_id"), "config.json key 'eos_token_id'"),
        )


def _flag(hf: dict[str, Any], key: str) -> bool:
    """A boolean config.json key (absent or null: false); anything else is refused naming the key."""
    value = hf.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"config.json key {key!r} must be true or false, got {value!r}")
    return value


def _family_switches(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The architecture-specific switches, spelled as transformers' own modeling code reads config.json."""
    if arch == "LlamaForCausalLM":
        attn = _flag(hf, "attention_bias")
        return {"qkv_bias": attn, "o_bias": attn, "mlp_bias": _flag(hf, "mlp_bias")}
    if arch == "MistralForCausalLM":
        # transformers' Mistral has no bias switches (every projection is bias-free, whatever else config.json
        # holds) and applies `sliding_window` to every layer; it ignores `layer_types`.
        return {"sliding_window": hf.get("sliding_window")}
    if arch == "Qwen2ForCausalLM":
        # Qwen2 hard-codes biases on q/k/v and none on o_proj or the MLP.
        return {"qkv_bias": True, **_qwen_window(hf)}
    if arch == "Phi3ForCausalLM":
        # transformers' Phi3: every projection bias-free, `sliding_window` (null or an int) on every layer.
        return {"sliding_window": hf.get("sliding_window")}
    attn = _flag(hf, "attention_bias")  # Qwen3ForCausalLM
    return {"qkv_bias": attn, "o_bias": attn, "qk_norm": True, **_qwen_window(hf)}


def _phi3_rope_names(hf: dict[str, Any]) -> dict[str, Any]:
    """Phi3's older rope type names, as transformers' Phi3Config renames them: "su" and "yarn" mean longrope."""
    out = dict(hf)
    for key in ("rope_scaling", "rope_parameters"):
        params = hf.get(key)
        if isinstance(params, dict):
            for name in ("type", "rope_type"):
                if params.get(name) in ("su", "yarn"):
                    params = {**params, name: "longrope"}
            out[key] = params
    return out


def _qwen_window(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen2/Qwen3's sliding window and the layers it applies to (`sliding_window`, `sliding_layers`), both None
    when no layer slides.

    transformers nulls `sliding_window` unless `use_sliding_window` is true (released Qwen checkpoints ship
    `use_sliding_window: false` next to a `sliding_window` smaller than their context: no window), and then
    slides the layers `layer_types` marks (5.x files), else the layers from `max_window_layers` on (4.x files,
    default 28)."""
    window = hf.get("sliding_window")
    none = {"sliding_window": None, "sliding_layers": None}
    if not _flag(hf, "use_sliding_window") or window is None:
        return none
    layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        if (
            not isinstance(layer_types, list)
            or any(t not in LAYER_TYPES for t in layer_types)
            or len(layer_types) != layers
        ):
            raise ValueError(
                f"unsupported config.json key 'layer_types' {layer_types!r}: {layers} entries (one a layer), each "
                f"one of {', '.join(LAYER_TYPES)}"
            )
        sliding = tuple(t == "sliding_attention" for t in layer_types)
    else:
        first = hf.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int):
            raise ValueError(f"config.json key 'max_window_layers' must be an int, got {first!r}")
        sliding = tuple(i >= first for i in range(layers) if isinstance(layers, int))
    return {"sliding_window": window, "sliding_layers": sliding} if any(sliding) else none


def eos_ids(value: Any, where: str) -> tuple[int, ...]:
    """An EOS entry (null, int or list of ints) as a tuple; `where` names the key in errors."""
    if value is None:
        return ()
    values = value if isinstance(value, list | tuple) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{where} must be an int or a list of ints, got {value!r}")
    return tuple(values)
