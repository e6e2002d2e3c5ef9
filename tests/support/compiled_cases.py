"""The cases the compiled-step tests share: a tiny Llama config, the ladders, ragged prompts, the compile settings
that keep a check to seconds on the CPU, and a lazily compiled generator."""

from __future__ import annotations

from capture import CaptureOptions, CompileSettings
from capture import _dynamo_counters as dc
from static_decode import Generator, Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
MAX_LEN, CHUNK, LADDER = 64, 8, (32, 64)
EMBEDDED_LADDER = (16, 32, 48, 64)  # the inductor cases: 4 rungs, one compile per kind covers them all
GREEDY = ("prefill", "first_greedy", "decode_greedy")
PROMPTS = [[5, 9, 2, 7, 7], [3] * 11 + [4, 8], [1, 2]]  # ragged: 5, 13 and 2 tokens, 1-2 prefill chunks
EAGER_BACKEND = CompileSettings(backend="eager")  # a static read length: one graph per (kind, rung)
SYMBOLIC_EAGER = CompileSettings(backend="eager", symbolic_read_len=True)  # one graph per kind
GRAPHS_PER_SYMBOLIC_KIND = 1 if dc.has_dynamic_int() else 2  # without DynamicInt: static first rung, then symbolic


def lazy(model: Llama, ladder, settings: CompileSettings = EAGER_BACKEND, **kw) -> Generator:
    opts = CaptureOptions(buckets=ladder, settings=settings, warm_up="lazy", progress=False)
    return Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, compile=True, eos_token_ids=[], capture=opts, **kw)
