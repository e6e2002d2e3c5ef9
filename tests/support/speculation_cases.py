"""The cases the speculative-decoding tests share: repetitive ragged prompts (prompt lookup finds matches), plain
greedy decode to compare with, and one policy of each kind over a target and a draft model."""

from __future__ import annotations

from static_decode import DraftModel, Generator, PromptLookup

# Repetitive prompts give prompt lookup matches; the third row is ragged and short.
PROMPTS = [[5, 17, 33, 2, 90, 61, 7, 5, 17, 33, 2], [40, 41, 40, 41, 40], [9] * 3 + [12, 13, 14, 9, 9, 9, 12]]


def plain(model, prompts, n, **kw):
    return Generator(model, max_len=96, chunk_size=8, eos_token_ids=kw.pop("eos", [])).generate(prompts, n, **kw)


def specs(models):
    target, other = models
    return {
        "lookup": PromptLookup(tokens=4, ngram=2, min_tokens_per_step=0, skip_unmatched=False),
        "lookup-k1-n3": PromptLookup(tokens=1, ngram=3, min_tokens_per_step=0, skip_unmatched=False),
        "lookup-skip": PromptLookup(tokens=4, ngram=2, min_tokens_per_step=0, skip_unmatched=True),
        "draft-self": DraftModel(target, tokens=3, min_tokens_per_step=0),
        "draft-other": DraftModel(other, tokens=4, min_tokens_per_step=0),
    }
