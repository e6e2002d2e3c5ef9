"""static-decode: grouped-query attention over a preallocated KV cache, with fixed-shape decode steps."""

from static_decode.attention import gqa_attention, grouped_attention
from static_decode.cache import StaticKVCache
from static_decode.config import LlamaConfig
from static_decode.generator import Generator
from static_decode.loading import load_model, load_tokenizer
from static_decode.model import Llama
from static_decode.parallel import TensorParallel

__all__ = [
    "Generator",
    "Llama",
    "LlamaConfig",
    "StaticKVCache",
    "TensorParallel",
    "gqa_attention",
    "grouped_attention",
    "load_model",
    "load_tokenizer",
]
__version__ = "0.1.0"
