"""The bytes each token of a tokenizer stands for: what a grammar over text needs to know of a vocabulary.

Byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen) spells every byte as one printable character (`bytes_to_unicode`);
SentencePiece-style vocabularies (Llama 2, Mistral) spell a space as U+2581 and bytes as `<0xNN>` tokens. Added
(special) tokens stand for no text: a grammar never allows them.
"""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable character -> byte map (the inverse of its `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    spec = json.loads(tokenizer.to_str())
    parts = [spec.get("decoder") or {}, spec.get("pre_tokenizer") or {}]
    for part in list(parts):
        parts.extend(part.get("decoders", []) + part.get("pretokenizers", []))
    return any(p.get("type") == "ByteLevel" for p in parts)


def token_bytes(tokenizer: Tokenizer) -> dict[int, bytes]:
    """token id -> the bytes it decodes to, for every token but the added (special) ones."""
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    byte_level = _is_byte_level(tokenizer)
    decoder = _byte_level_decoder() if byte_level else {}
    out: dict[int, bytes] = {}
    for text, i in tokenizer.get_vocab(with_added_tokens=False).items():
        if text in special:
            continue
        if byte_level:
            if any(c not in decoder for c in text):
                continue  # not a byte-level spelling: no text a grammar could match
            out[i] = bytes(decoder[c] for c in text)
        elif m := _BYTE_TOKEN.fullmatch(text):
            out[i] = bytes([int(m.group(1), 16)])
        else:
            out[i] = text.replace("\u2581", " ").encode()
    return out
