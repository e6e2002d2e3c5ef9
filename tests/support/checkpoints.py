"""Shared test helper: tiny random Llama-family checkpoints written by transformers' own save_pretrained.

The transformers model that wrote a checkpoint is the independent reference the tests compare against.
`hf_llama` builds LlamaForCausalLM; `hf_family` any supported family (Llama, Mistral, Qwen2, Qwen3). `feed`
runs our model over ragged rows in fixed chunks, for comparing its logits with transformers' (`hf_logits`).
`tiny_gguf` writes a one-layer float32 llama GGUF (the gguf package) for the llama.cpp bench system's tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

VOCAB = 96
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # With head_dim 8 and theta 5e5 the wavelengths are ~6, ~167, ~4.4e3, ~1.2e5: one below
    # 256 / high_freq_factor (kept), one between (smoothed), two above 256 / low_freq_factor (divided).
    "original_max_position_embeddings": 256,
}


def hf_llama(
    *,
    rope: str = "default",
    tied: bool = False,
    seed: int = 0,
    head_dim: int | None = None,
    eos: int | list[int] | None = None,
    layers: int = 2,
    vocab: int = VOCAB,
    kv_heads: int = 2,
    bias: bool = False,
    hidden: int = 64,
):
    """A random transformers LlamaForCausalLM: hidden 64 (`hidden`; the MLP twice it), GQA 8 query / 2 KV heads
    (kv_heads to change), weights
    large enough that logits spread over several units (so a 1e-4 agreement is not trivially met by near-zero
    logits). bias=True: every projection has a (random, nonzero) bias."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        rope_theta=500000.0 if rope == "llama3" else 10000.0,
        rope_scaling=dict(LLAMA3_ROPE) if rope == "llama3" else None,
        tie_word_embeddings=tied,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=None,
        attention_bias=bias,
        mlp_bias=bias,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    if bias:  # transformers initialises biases to zero, which would hide a bias added once per rank
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.2)
    return model


# family -> transformers class prefix ({prefix}Config, {prefix}ForCausalLM)
FAMILIES = {
    "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3", "gemma2": "Gemma2",
    "gemma3": "Gemma3",
}
CONFIG_CLASSES = {"gemma3": "Gemma3TextConfig"}  # where the config class is not {prefix}Config


def hf_family(
    family: str,
    *,
    seed: int = 0,
    tied: bool = False,
    layers: int = 2,
    kv_heads: int = 2,
    eos: int | list[int] | None = None,
    **config: Any,
):
    """A random tiny transformers {Llama,Mistral,Qwen2,Qwen3,Phi3,Gemma2,Gemma3}ForCausalLM: hidden 64, 4 query /
    `kv_heads` KV heads, vocab 96, rope theta 1e6 (not the 1e4 default, so a theta read from the wrong key shows).
    `config` adds the family's own keys (head_dim, attention_bias, mlp_bias, sliding_window, use_sliding_window, ...).

    Biases and RMSNorm weights are drawn at random: transformers initialises them to 0 and 1, which would hide a
    bias that is missing, added on every rank, or a q/k norm applied to the wrong axis or not at all."""
    import transformers

    prefix = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, CONFIG_CLASSES.get(family, f"{prefix}Config"))(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        rope_theta=1e6,
        tie_word_embeddings=tied,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=None,
        **config,
    )
    if family.startswith("gemma"):
        cfg._attn_implementation = "eager"  # transformers' own path for softcapped scores
    model = getattr(transformers, f"{prefix}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    return model


def prompt(n: int, seed: int = 0) -> list[int]:
    """n random token ids (a fixed sequence per seed)."""
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def feed(model, rows: list[list[int]], chunk: int, max_len: int = 128) -> list[torch.Tensor]:
    """Feed ragged rows together in chunks of `chunk` slots (padding past each row's n_new with a nonzero id,
    so a leak would show); return each row's logits of its real slots, [len(row), V]."""
    cache = model.new_cache(len(rows), max_len)
    lens = np.array([len(r) for r in rows])
    got: list[list[torch.Tensor]] = [[] for _ in rows]
    for start in range(0, lens.max(), chunk):
        n = np.clip(lens - start, 0, chunk)
        tokens = torch.full((len(rows), chunk), 7, dtype=torch.int64)  # [B, chunk]
        for b, row in enumerate(rows):
            tokens[b, : n[b]] = torch.tensor(row[start : start + n[b]], dtype=torch.int64)
        with torch.no_grad():
            logits = model(tokens, cache, n)  # [B, chunk, V]
        for b in range(len(rows)):
            got[b].append(logits[b, : n[b]])
    assert cache.host_lens.tolist() == lens.tolist()
    assert cache.lens.tolist() == lens.tolist()
    return [torch.cat(g) for g in got]


def save(model, path: Path, **kwargs) -> Path:
    """save_pretrained into `path` (kwargs go to save_pretrained, e.g. max_shard_size)."""
    model.save_pretrained(path, **kwargs)
    return path


def rewrite_config(path: Path, edit) -> None:
    """Apply `edit(dict) -> None` to path/config.json in place."""
    file = path / "config.json"
    cfg = json.loads(file.read_text())
    edit(cfg)
    file.write_text(json.dumps(cfg, indent=2))


def to_4x_style(cfg: dict) -> None:
    """Turn a 5.x config.json dict into the 4.x layout: top-level rope_theta plus rope_scaling."""
    params = dict(cfg.pop("rope_parameters", None) or {})
    if "rope_theta" in params:
        cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = None if params.get("rope_type", "default") == "default" else params


def hf_greedy(model, prompt: list[int], max_new: int, eos: int | list[int] | None) -> list[int]:
    """transformers' greedy continuation of one prompt (EOS included when emitted)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )
    return out[0, len(prompt) :].tolist()


def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), V] float32 logits of transformers' full-sequence forward."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def byte_tokenizer():
    """A `tokenizers` byte-level tokenizer: token id = byte value (vocab 256), decoding back to the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # GPT-2's printable stand-ins for the 256 bytes, so that id i is the character of byte i.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def tiny_gguf(path: Path, vocab: int = 256, hidden: int = 64, ff: int = 128) -> int:
    """A one-layer llama GGUF in float32 with random weights and a byte vocabulary; returns its weights' count."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(ff)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // 2)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list([b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(vocab - 3)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [6] * (vocab - 3))
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (vocab, hidden), "blk.0.attn_q": (hidden, hidden), "blk.0.attn_k": (hidden // 2, hidden),
              "blk.0.attn_v": (hidden // 2, hidden), "blk.0.attn_output": (hidden, hidden),
              "blk.0.ffn_gate": (ff, hidden), "blk.0.ffn_up": (ff, hidden), "blk.0.ffn_down": (hidden, ff)}
    for name, shape in shapes.items():
        w.add_tensor(f"{name}.weight", (rng.standard_normal(shape) * 0.1).astype(np.float32))
    for name in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm"):
        w.add_tensor(f"{name}.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sum(a * b for a, b in shapes.values())


def llama_cpp_system_info() -> str:
    """The installed llama.cpp build's system line ("... AMX_INT8 = 1 | ..."), asked in a subprocess."""
    import subprocess
    import sys

    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
