"""Shared test helper: a checkpoint whose greedy reply is a script written in advance.

`scripted_checkpoint(path, script)` writes a one-layer transformers Llama whose next token depends only on the
current one: the embedding is one-hot, attention and MLP write nothing (o_proj and down_proj are zero), and the LM
head maps token t to `script`'s successor of t. So after a prompt ending in the script's first token the model
emits the rest of the script, then EOS. The tokenizer is the byte tokenizer (id = byte) with `added` tokens after
it (256, 257, ...) and a BOS "<s>" after those, added by its post-processor when special tokens are asked for.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.checkpoints import byte_tokenizer, hf_llama, save

EOS = ord("$")


def scripted_tokenizer(added: list[str]):
    from tokenizers import AddedToken, processors

    tok = byte_tokenizer()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)])
    return tok


def scripted_checkpoint(path: Path, script: list[int], *, added: list[str], template: str) -> Path:
    """A checkpoint in `path` that continues script[0] with script[1:] and then EOS ('$'), greedily."""
    tok = scripted_tokenizer(added)
    vocab, hidden = 264, 320
    assert tok.get_vocab_size() <= vocab and len(set(script)) == len(script), "each token once: one successor"
    model = hf_llama(vocab=vocab, hidden=hidden, head_dim=32, layers=1, eos=EOS)
    following = {a: b for a, b in zip(script, [*script[1:], EOS], strict=True)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))  # [V, H]: token t is the unit vector e_t
        head = torch.zeros(vocab, hidden)  # [V, H]
        for t in range(vocab):
            head[following.get(t, EOS), t] = 1.0
        model.lm_head.weight.copy_(head)
    save(model, path)
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(template)
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "$"}))
    return path
