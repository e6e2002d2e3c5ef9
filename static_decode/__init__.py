"""static-decode: grouped-query attention over a preallocated KV cache, with fixed-shape decode steps.

The public names below are imported on first use (PEP 562): `import static_decode.core.cache` loads the cache
alone, not the generator, and the core modules never depend on this package's own namespace.
"""

from __future__ import annotations

from static_decode.base.exports import lazy_exports

_EXPORTS = {
    "Conversation": "static_decode.generation.conversation",
    "DraftModel": "static_decode.steps.speculation",
    "Generator": "static_decode.generation.generator",
    "GenerationStats": "static_decode.generation.stats",
    "Llama": "static_decode.model.llama",
    "PromptLookup": "static_decode.steps.speculation",
    "SamplingParams": "static_decode.generation.request",
    "LlamaConfig": "static_decode.model.config",
    "StaticKVCache": "static_decode.core.cache",
    "TensorParallel": "static_decode.model.parallel",
    "TokenLogprob": "static_decode.steps.logprobs",
    "gqa_attention": "static_decode.core.attention",
    "grouped_attention": "static_decode.core.attention",
    "load_model": "static_decode.checkpoints.loading",
    "load_tokenizer": "static_decode.checkpoints.loading",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
