"""The rotary embedding's parameters: a validated dataclass, read from config.json as transformers reads it.

Rope types "default", "linear", "dynamic", "yarn", "longrope" and "llama3" (transformers' `rope_type`), and
`partial_rotary_factor`; both config.json spellings (4.x `rope_theta` + `rope_scaling`, 5.x `rope_parameters`). A key
a type does not read, or a type not listed, is refused naming the key. Each type: docs/internals.md#rope-config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from static_decode.base.checks import check_int, is_number

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# The keys each type reads from the rope dict besides rope_type / type / rope_theta / partial_rotary_factor, and
# those of them transformers requires (original_max_position_embeddings it defaults to max_position_embeddings).
TYPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": (
        "factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
        "mscale_all_dim", "truncate",
    ),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor", "attention_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}
COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
# Types whose pretraining context transformers takes from a top-level `original_max_position_embeddings` first.
ORIGINAL_CONTEXT_TYPES = ("llama3", "yarn", "longrope")
DEFAULT_MAX_POSITIONS = 2048  # transformers' LlamaConfig default for a config.json without max_position_embeddings


def _check_positive_float(name: str, value: Any) -> None:
    if not is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _check_finite(name: str, value: Any) -> None:
    if not is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (transformers' `rope_parameters`, defaults resolved)."""

    theta: float = 10000.0  # base wavelength: inv_freq[i] = theta ** (-2i / rot_dim)
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear/dynamic/yarn/llama3: the context scale; longrope: sets the default attention factor
    low_freq_factor: float = 1.0  # llama3: wavelengths above original_max / low_freq_factor are scaled fully
    high_freq_factor: float = 4.0  # llama3: wavelengths below original_max / high_freq_factor are kept
    # llama3/yarn/longrope: the pretraining context; dynamic: the length past which the base grows
    original_max_position_embeddings: int = 8192
    attention_factor: float | None = None  # yarn/longrope: cos/sin scale; None: derived from factor (transformers)
    beta_fast: float = 32.0  # yarn: rotations bounding the extrapolated (kept) dims
    beta_slow: float = 1.0  # yarn: rotations bounding the interpolated (divided) dims
    mscale: float | None = None  # yarn: with mscale_all_dim, the attention factor's numerator scale
    mscale_all_dim: float | None = None  # yarn: with mscale, the attention factor's denominator scale
    truncate: bool = True  # yarn: floor/ceil the ramp's bounds to whole dims
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors within the original context
    long_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors past it
    partial_rotary_factor: float = 1.0  # the fraction of each head's dims that rotate (the first ones)
    # "default": per-frequency divisors of the table (a GGUF's rope_freqs, as llama.cpp writes Llama 3.x's scaling:
    # frequency i divided by freq_factors[i]); () for none
    freq_factors: tuple[float, ...] = ()

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
        if self.attention_factor is not None:
            _check_positive_float("rope attention_factor", self.attention_factor)
        _check_finite("rope beta_fast", self.beta_fast)
        _check_finite("rope beta_slow", self.beta_slow)
        if self.beta_fast < self.beta_slow:
            raise ValueError(f"yarn rope needs beta_fast >= beta_slow, got {self.beta_fast} < {self.beta_slow}")
        for name in ("mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                _check_finite(f"rope {name}", getattr(self, name))
        if not isinstance(self.truncate, bool):
            raise TypeError(f"rope truncate must be a bool, got {self.truncate!r}")
        if self.freq_factors and self.type != "default":
            raise ValueError(f"rope freq_factors divide the default table; this rope is {self.type!r}")
        for name in ("short_factor", "long_factor", "freq_factors"):
            values = getattr(self, name)
            if not isinstance(values, list | tuple):
                raise TypeError(f"rope {name} must be a list of numbers, got {values!r}")
            for v in values:
                _check_positive_float(f"every rope {name} entry", v)
            object.__setattr__(self, name, tuple(float(v) for v in values))
        if self.type == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError(
                f"longrope needs short_factor and long_factor of one nonzero length, got "
                f"{len(self.short_factor)} and {len(self.long_factor)}"
            )
        _check_positive_float("rope partial_rotary_factor", self.partial_rotary_factor)
        if self.partial_rotary_factor > 1:
            raise ValueError(f"rope partial_rotary_factor must lie in (0, 1], got {self.partial_rotary_factor}")

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading dims of a head rotate: int(head_dim * partial_rotary_factor), as transformers."""
        return int(head_dim * self.partial_rotary_factor)

    def check(self, head_dim: int) -> None:
        """Refuse parameters that do not fit heads of `head_dim` dims (an odd rotary width, factor lists whose
        length is not rot_dim / 2), naming both numbers."""
        rot = self.rotary_dim(head_dim)
        if rot < 2 or rot % 2:
            raise ValueError(
                f"the rotary width int(head_dim={head_dim} * partial_rotary_factor={self.partial_rotary_factor}) = "
                f"{rot} must be even and at least 2 (the embedding rotates pairs)"
            )
        if self.type == "dynamic" and rot == 2:
            raise ValueError("dynamic rope needs a rotary width above 2 (its base grows as ** (rot / (rot - 2)))")
        if self.freq_factors and len(self.freq_factors) != rot // 2:
            raise ValueError(f"rope freq_factors hold {len(self.freq_factors)} values; the rotary width {rot} needs "
                             f"{rot // 2} (one per frequency)")
        if self.type == "longrope" and len(self.short_factor) != rot // 2:
            raise ValueError(
                f"longrope short_factor and long_factor hold {len(self.short_factor)} values; the rotary width "
                f"{rot} needs {rot // 2} (one per frequency)"
            )


def rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    """The rotary parameters of a config.json dict, from `rope_parameters` (5.x) or `rope_theta` + `rope_scaling`
    (4.x), defaults filled as transformers fills them; errors name the key."""
    scaling, params5 = hf.get("rope_scaling"), hf.get("rope_parameters")
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params5)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"config.json key {key!r} must be an object or null, got {value!r}")
    if scaling and params5:
        differ = sorted(k for k in {*scaling, *params5} - {"rope_theta"} if scaling.get(k) != params5.get(k))
        if differ:
            raise ValueError(
                f"config.json holds both 'rope_scaling' and 'rope_parameters', differing in {', '.join(differ)}; "
                "keep one"
            )
    # transformers takes a non-empty rope_scaling over rope_parameters.
    params, key = (dict(scaling), "rope_scaling") if scaling else (dict(params5 or {}), "rope_parameters")
    where = f"config.json key '{key}"
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))  # the dict's own first, as transformers
    if not is_number(theta):
        raise ValueError(f"config.json rope_theta must be a number, got {theta!r}")
    if "rope_type" in params and "type" in params and params["rope_type"] != params["type"]:
        raise ValueError(f"{where}' names two rope types: rope_type={params['rope_type']!r}, type={params['type']!r}")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type: {where}.rope_type' is {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    unknown = [k for k in params if k not in COMMON_KEYS + TYPE_KEYS[rope_type]]
    if unknown:
        reads = ", ".join(COMMON_KEYS[2:] + TYPE_KEYS[rope_type])
        raise ValueError(f"unsupported {where}.{unknown[0]}' for rope type {rope_type!r} (it reads {reads})")
    missing = [k for k in REQUIRED_KEYS[rope_type] if k not in params]
    if missing:
        raise ValueError(f"{rope_type} rope needs config.json key(s) {', '.join(f'{key}.{k}' for k in missing)}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    max_positions = hf.get("max_position_embeddings", DEFAULT_MAX_POSITIONS)
    fields: dict[str, Any] = {"theta": float(theta), "type": rope_type}
    if partial is not None:
        fields["partial_rotary_factor"] = partial
    if rope_type == "default":
        return _build(fields, where)
    if rope_type == "dynamic":
        fields["original_max_position_embeddings"] = max_positions
    if rope_type in ORIGINAL_CONTEXT_TYPES:
        # transformers: a top-level original_max_position_embeddings (Phi3's spelling) over the dict's, then
        # the dict's, then max_position_embeddings.
        fields["original_max_position_embeddings"] = hf.get(
            "original_max_position_embeddings", params.get("original_max_position_embeddings", max_positions)
        )
    factor = params.get("factor")
    if factor is None and rope_type in ("yarn", "longrope"):
        factor = max_positions / fields["original_max_position_embeddings"]  # transformers' derived factor
    fields["factor"] = factor
    for name in ("low_freq_factor", "high_freq_factor", "attention_factor", "mscale", "mscale_all_dim",
                 "short_factor", "long_factor"):
        if params.get(name) is not None:
            fields[name] = params[name]
    if rope_type == "yarn":
        # transformers: `or 32` / `or 1`, so a null or zero beta takes the default too.
        fields["beta_fast"] = params.get("beta_fast") or 32.0
        fields["beta_slow"] = params.get("beta_slow") or 1.0
        fields["truncate"] = params.get("truncate", True)
    if isinstance(fields["factor"], int) and not isinstance(fields["factor"], bool):
        fields["factor"] = float(fields["factor"])
    return _build(fields, where)


def _build(fields: dict[str, Any], where: str) -> RopeConfig:
    """RopeConfig(**fields), its errors prefixed with the config.json key they were read from."""
    try:
        return RopeConfig(**fields)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}' ({fields['type']}): {e}") from e
