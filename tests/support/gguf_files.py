"""Shared test helper: GGUF files of tiny transformers checkpoints, written by llama.cpp's own tools.

`convert` runs `convert_hf_to_gguf.py` of the llama-cpp-python sdist that profiles/smollm2.py pins (fetched once
from the package index, sha256-checked, cached) on a save_pretrained directory; `quantize` runs llama.cpp's
quantizer (`llama_cpp.llama_model_quantize`) on a float GGUF. `bpe_tokenizer` saves a small byte-level BPE
tokenizer trained here with one of the pre-tokenizers the GGUF loader reads.

The converter names a BPE tokenizer's pre-tokenizer by hashing its encoding of a fixed text and looking the hash
up in a table of released models; a tokenizer trained here is in no table, so `convert(..., pre=NAME)` gives the
converter that name instead of the hash's (everything else it writes: tokens, types, merges, special ids, the
chat template, is its own). llama.cpp then tokenizes with that pre-tokenizer, so a wrong name shows as llama.cpp's
ids differing from the directory's.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# transformers' pre-tokenizer of each family, as their tokenizer.json files spell it (GGUF's tokenizer.ggml.pre)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def smollm2_profile():
    """profiles/smollm2.py as a module (its converter and quantizer helpers)."""
    spec = importlib.util.spec_from_file_location("sd_profiles_smollm2_gguf", ROOT / "profiles" / "smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def convert(checkpoint: Path, outtype: str, outfile: Path, pre: str | None = None) -> Path:
    """convert_hf_to_gguf.py CHECKPOINT --outtype OUTTYPE --outfile OUTFILE (pre: the pre-tokenizer name to write
    for a BPE tokenizer, see the module docstring)."""
    script = smollm2_profile().fetch_converter()
    vendor = script.parent
    code = (
        "import runpy, sys\n"
        f"sys.path[:0] = [{str(vendor / 'gguf-py')!r}, {str(vendor)!r}]\n"
        "import conversion.base as base\n"
        f"pre = {pre!r}\n"
        "if pre is not None:\n"
        "    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre\n"
        f"sys.argv = [{str(script)!r}, {str(checkpoint)!r}, '--outtype', {outtype!r}, '--outfile', {str(outfile)!r}]\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not outfile.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return outfile


def quantize(source: Path, qtype: str, outfile: Path) -> Path:
    """llama.cpp's quantizer (llama_model_quantize) from float GGUF `source` to `qtype` ("Q8_0", "Q4_0", ...)."""
    smollm2_profile().quantize_gguf(source, qtype, outfile)
    return outfile


def bpe_tokenizer(path: Path, pre: str = "smollm", vocab: int = 384):
    """A byte-level BPE tokenizer (trained on README.md, `vocab` tokens, SPECIALS first) with the pre-tokenizer of
    `pre` ("gpt-2", "smollm", "llama-bpe", "qwen2"), saved into `path` by transformers with CHAT_TEMPLATE and
    <|im_end|> as EOS; returns the `tokenizers` Tokenizer."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre in ("gpt-2", "smollm"))
    split = {"llama-bpe": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}.get(pre)
    steps = {
        "gpt-2": [byte_level],
        "smollm": [pre_tokenizers.Digits(individual_digits=True), byte_level],
        "llama-bpe": [pre_tokenizers.Split(Regex(split or ""), behavior="isolated", invert=False), byte_level],
        "qwen2": [pre_tokenizers.Split(Regex(split or ""), behavior="isolated", invert=False), byte_level],
    }[pre]
    tok = Tokenizer(models.BPE(ignore_merges=pre == "llama-bpe"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = [ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.strip()]
    tok.train_from_iterator(lines, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                bos_token="<|im_start|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return Tokenizer.from_file(str(path / "tokenizer.json"))
