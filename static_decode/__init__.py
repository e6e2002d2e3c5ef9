"""static-decode: grouped-query attention over a preallocated KV cache, with fixed-shape decode steps.

The public names below are imported on first use (PEP 562): `import static_decode.cache` loads the cache
alone, not the generator, and the core modules never depend on this package's own namespace.
"""

from __future__ import annotations

from static_decode.exports import lazy_exports

_EXPORTS = {
    "Conversation": "static_decode.conversation",
    "DraftModel": "static_decode.speculation",
    "Generator": "static_decode.generator",
    "GenerationStats": "static_decode.stats",
    "Llama": "static_decode.model",
    "PromptLookup": "static_decode.speculation",
    "LlamaConfig": "static_decode.config",
    "StaticKVCache": "static_decode.cache",
    "TensorParallel": "static_decode.parallel",
    "gqa_attention": "static_decode.attention",
    "grouped_attention": "static_decode.attention",
    "load_model": "static_decode.loading",
    "load_tokenizer": "static_decode.loading",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
