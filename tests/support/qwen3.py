"""Shared test helper: a tiny Qwen3-shaped tokenizer directory with Qwen3's real chat template.

`qwen3_chat_template.jinja` beside this file is the chat template of Qwen/Qwen3-0.6B (the one with
`enable_thinking`, tools in `<tools>`, `<tool_call>` and `<tool_response>`), as llama.cpp keeps it in
models/templates/Qwen-Qwen3-0.6B.jinja. `qwen3_tokenizer_dir` writes a byte-level tokenizer with Qwen3's added
tokens (<|im_start|>, <|im_end|>, <|endoftext|> special; <think>, </think>, <tool_call>, ... not) and a
tokenizer_config.json as Qwen3's (eos <|im_end|>, pad <|endoftext|>, no bos), so that transformers'
`AutoTokenizer.from_pretrained(dir).apply_chat_template(...)` is the reference for the rendered ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.checkpoints import byte_tokenizer

TEMPLATE = Path(__file__).with_name("qwen3_chat_template.jinja")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def qwen3_tokenizer(tokens: list[str] | None = None):
    """The byte tokenizer (ids 0..255 = bytes) with Qwen3's added tokens after it (256...)."""
    from tokenizers import AddedToken

    tok = byte_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (tokens or ADDED)])
    return tok


def qwen3_tokenizer_dir(path: Path, *, chat_template: str | None = None, added: list[str] | None = None) -> Path:
    """tokenizer.json, tokenizer_config.json (Qwen3's special tokens) and chat_template.jinja in `path`."""
    path.mkdir(parents=True, exist_ok=True)
    qwen3_tokenizer(added).save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "add_bos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": 4096}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (path / "chat_template.jinja").write_text(TEMPLATE.read_text() if chat_template is None else chat_template)
    return path
