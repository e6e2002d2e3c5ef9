"""A GGUF file's tokenizer, chat template and special ids, from its `tokenizer.*` metadata.

The tokenizer is rebuilt as a `tokenizers` Tokenizer, as transformers' own GGUF reader does, for the byte-level BPE
type (`tokenizer.ggml.model` "gpt2": GPT-2, SmolLM, Llama 3, Qwen2 and their kin): the vocabulary
(`tokenizer.ggml.tokens`, id = position), the merges (`tokenizer.ggml.merges`, "a b" in rank order), control and
user-defined tokens (`tokenizer.ggml.token_type` 3 and 4) as added tokens (special and not), and the pre-tokenizer
llama.cpp names in `tokenizer.ggml.pre`, spelled as those models' tokenizer.json files spell it. Other tokenizer
types (SentencePiece "llama", WordPiece "bert", ...) and pre-tokenizers are refused naming them and the file.
A BOS is prepended where `tokenizer.ggml.add_bos_token` says so.

The chat template is `tokenizer.chat_template`, its bos/eos strings the tokens of `tokenizer.ggml.bos_token_id` /
`eos_token_id` (the ids that end a sequence are static_decode.checkpoints.gguf's `eos_ids`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from static_decode.checkpoints.gguf import field, open_gguf
from static_decode.text.chat_template import ChatTemplate

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (gguf.TokenType)
# tokenizer.ggml.pre -> the Split regex before the byte-level step (None: the byte-level step's own GPT-2 regex)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("gpt-2", "smollm", "llama-bpe", "llama3", "llama-v3", "qwen2")


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # digits one by one, then GPT-2's regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = QWEN2_SPLIT if pre == "qwen2" else LLAMA3_SPLIT
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def gguf_tokenizer(path: str | Path) -> Any:  # -> tokenizers.Tokenizer
    """The `tokenizers` Tokenizer of a GGUF file's metadata (see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    file = Path(path)
    reader = open_gguf(file)
    kind = field(reader, "tokenizer.ggml.model", file)
    if kind != "gpt2":
        raise ValueError(f"{file}: GGUF key 'tokenizer.ggml.model' is {kind!r}; static-decode builds the byte-level "
                         "BPE tokenizer ('gpt2') only")
    pre = field(reader, "tokenizer.ggml.pre", file, "")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{file}: GGUF key 'tokenizer.ggml.pre' is {pre!r}; static-decode knows "
                         f"{', '.join(PRE_TOKENIZERS)}")
    tokens = field(reader, "tokenizer.ggml.tokens", file)
    types = field(reader, "tokenizer.ggml.token_type", file, [1] * len(tokens))
    merges = field(reader, "tokenizer.ggml.merges", file)
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token in vocab:
            raise ValueError(f"{file}: tokenizer.ggml.tokens holds {token!r} twice (ids {vocab[token]} and {i})")
        vocab[token] = i
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep or not a or not b:
            raise ValueError(f"{file}: tokenizer.ggml.merges entry {m!r} is not two tokens separated by a space")
        pairs.append((a, b))
    llama3 = pre in ("llama-bpe", "llama3", "llama-v3")  # llama.cpp and Llama 3's tokenizer.json: ignore_merges
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=llama3, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for i, t in enumerate(tokens) if types[i] == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for i, t in enumerate(tokens) if types[i] == USER_DEFINED])
    bos = field(reader, "tokenizer.ggml.bos_token_id", file, None)
    if field(reader, "tokenizer.ggml.add_bos_token", file, False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], int(bos))])
    return tok


def gguf_chat_template(path: str | Path) -> ChatTemplate | None:
    """The file's `tokenizer.chat_template` (None when it has none), with its BOS and EOS token strings."""
    file = Path(path)
    reader = open_gguf(file)
    source = field(reader, "tokenizer.chat_template", file, None)
    if not isinstance(source, str) or not source:
        return None
    tokens = field(reader, "tokenizer.ggml.tokens", file, [])

    def text(key: str) -> str:
        i = field(reader, key, file, None)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else ""

    return ChatTemplate(source, bos_token=text("tokenizer.ggml.bos_token_id"),
                        eos_token=text("tokenizer.ggml.eos_token_id"), origin=f"{file} (tokenizer.chat_template)")
