"""The default model's corpus (the standard library's Python files as bytes, 2% held out) and its byte-level
tokenizer (token id = byte value)."""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS_ID = 0
VOCAB_SIZE = 256
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})
HOLDOUT_EVERY = 50
PROMPTS = ("def ", "import ", "class ")


# --------------------------------------------------------------------------------------------- corpus


@dataclass
class Corpus:
    """Byte streams for training and evaluation, each file followed by one NUL (EOS) byte."""

    root: str
    train: bytes
    heldout: bytes
    train_files: list[str] = field(default_factory=list)
    heldout_files: list[str] = field(default_factory=list)
    skipped_files: list[str] = field(default_factory=list)

    @property
    def sha256(self) -> str:
        h = hashlib.sha256()
        h.update(self.train)
        h.update(self.heldout)
        return h.hexdigest()


def stdlib_py_files(root: Path) -> list[Path]:
    """The standard library's ``.py`` files under ``root``, in a deterministic order, minus excluded dirs."""
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]) or not path.is_file():
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def build_corpus(root: Path | None = None) -> Corpus:
    """Read the stdlib sources; every ``HOLDOUT_EVERY``-th file goes to the held-out stream."""
    root = Path(root or sysconfig.get_paths()["stdlib"]).resolve()
    train, heldout = bytearray(), bytearray()
    corpus = Corpus(root=str(root), train=b"", heldout=b"")
    for i, path in enumerate(stdlib_py_files(root)):
        rel = path.relative_to(root).as_posix()
        data = path.read_bytes()
        if EOS_ID in data:  # NUL is the file separator; never let it appear inside a file.
            corpus.skipped_files.append(rel)
            continue
        if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1:
            heldout += data + bytes([EOS_ID])
            corpus.heldout_files.append(rel)
        else:
            train += data + bytes([EOS_ID])
            corpus.train_files.append(rel)
    corpus.train, corpus.heldout = bytes(train), bytes(heldout)
    return corpus


# ------------------------------------------------------------------------------------------ tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table, as used by ``ByteLevel``."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def build_byte_tokenizer() -> Tokenizer:
    """A ``tokenizers`` tokenizer mapping each byte 0..255 to the token id equal to its value.

    ByteLevel pre-tokenization (no regex split, no prefix space) turns the UTF-8 bytes of the text into
    the 256 byte-level symbols; a merge-free BPE model whose vocab lists those symbols in byte order then
    maps each symbol to its byte value; the ByteLevel decoder maps ids back to bytes and UTF-8 text.
    """
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def check_byte_tokenizer(tok: Tokenizer) -> None:
    """Fail loudly unless ids equal the UTF-8 bytes and decoding round-trips."""
    samples = [
        "def f(x):\n",
        "    return x  # ünïcødé → ✓ 日本\n",
        "\t\r\n \x01\x7f",
        "".join(map(chr, range(1, 128))),
    ]
    for text in samples:
        ids = tok.encode(text).ids
        assert ids == list(text.encode("utf-8")), (text, ids)
        assert tok.decode(ids) == text, (text, tok.decode(ids))
    assert tok.get_vocab_size() == VOCAB_SIZE
    assert tok.encode("\x00").ids == [EOS_ID]
