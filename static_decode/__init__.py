"""static-decode: grouped-query attention over a preallocated KV cache, with fixed-shape decode steps."""

from static_decode.attention import gqa_attention, grouped_attention
from static_decode.cache import StaticKVCache

__all__ = ["StaticKVCache", "gqa_attention", "grouped_attention"]
__version__ = "0.1.0"
