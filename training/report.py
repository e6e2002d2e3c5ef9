"""TRAINING.md: the corpus, the command, the hyperparameters, the losses, the versions and the samples of a run."""

from __future__ import annotations

import math
import platform
from pathlib import Path

import tokenizers
import torch
import transformers
from corpus import EXCLUDED_DIRS, HOLDOUT_EVERY, Corpus
from settings import TrainArgs, TrainResult
from transformers import LlamaConfig


def folder_size(out: Path) -> int:
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file() and p.suffix != ".py")


def write_training_md(
    out: Path,
    corpus: Corpus,
    config: LlamaConfig,
    n_params: int,
    args: TrainArgs,
    result: TrainResult,
    samples: list[tuple[str, str, str]],
    command: str,
) -> None:
    bpb = 1 / math.log(2)
    lines = [
        "# static-decode default model",
        "",
        "A tiny byte-level `LlamaForCausalLM` trained on the Python standard library's source, shipped as",
        "package data so that static-decode has a self-contained checkpoint to decode with. It writes",
        "Python-looking code; it is a test and demo fixture, not a useful language model.",
        "Produced by `training/train_default_model.py` (outside the package).",
        "",
        "## Files",
        "",
        "- `config.json`, `generation_config.json`, `model.safetensors`: written by transformers'",
        "  `save_pretrained(..., safe_serialization=True)`; float32 weights, tied embeddings (the",
        "  safetensors file holds `model.embed_tokens.weight` only, `lm_head` reuses it).",
        "- `tokenizer.json`: `tokenizers` byte-level tokenizer, token id = byte value (0..255), no merges;",
        "  decodes ids back to UTF-8 text. Byte 0 (NUL) is EOS and separates files in the corpus.",
        "- `training/train_default_model.py`: the training script (kept outside the importable package).",
        "",
        "## Corpus",
        "",
        f"- Source: the `.py` files of the Python {platform.python_version()} standard library at",
        f"  `{corpus.root}`, read as raw bytes in sorted POSIX relative-path order.",
        f"- Excluded folders: {', '.join(f'`{d}`' for d in sorted(EXCLUDED_DIRS))}.",
        "- License: the Python source is distributed under the PSF License Agreement (Python Software",
        "  Foundation License Version 2), which permits use, modification and distribution of derived works;",
        "  see https://docs.python.org/3/license.html. Copyright (c) 2001 Python Software Foundation; All",
        "  Rights Reserved.",
        "- Each file is followed by one NUL byte (token 0 = EOS), so the model learns to end a file.",
        f"- Held out: every {HOLDOUT_EVERY}th file ({len(corpus.heldout_files)} files, "
        f"{len(corpus.heldout):,} bytes incl. separators).",
        f"- Train: {len(corpus.train_files)} files, {len(corpus.train):,} bytes incl. separators; total "
        f"{len(corpus.train) + len(corpus.heldout):,} bytes; sha256 of train+held-out streams "
        f"`{corpus.sha256}`.",
        f"- Files skipped because they contain a NUL byte: {len(corpus.skipped_files)}"
        + (f" ({', '.join(corpus.skipped_files)})" if corpus.skipped_files else "")
        + ".",
        "",
        "## Model",
        "",
        "| field | value |",
        "|---|---|",
    ]
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        lines.append(f"| `{key}` | `{getattr(config, key)}` |")
    lines += [
        f"| rope | `{config.rope_parameters}` |",
        f"| parameters | {n_params:,} ({n_params * 4 / 1e6:.2f} MB as float32) |",
        "",
        "Grouped-query attention: 4 query heads share 2 KV heads (G = 2).",
        "",
        "## Training",
        "",
        f"Command (cwd = repository root):\n\n    {command}\n",
        f"To reproduce this exact run: `--steps {result.steps}` with the same other flags (with `--minutes`",
        "the step count is fixed from the step time measured during warmup, so it depends on the machine).",
        "",
        "| hyperparameter | value |",
        "|---|---|",
        f"| steps | {result.steps} |",
        f"| batch | {args.batch_size} windows x {args.seq_len} bytes = {args.batch_size * args.seq_len} tokens/step |",
        f"| tokens seen | {result.steps * args.batch_size * args.seq_len:,} |",
        "| optimizer | AdamW, betas (0.9, 0.95), eps 1e-8 |",
        f"| learning rate | peak {args.lr}, linear warmup {args.warmup} steps, cosine to "
        f"{args.lr * args.min_lr_ratio:.1e} |",
        f"| weight decay | {args.weight_decay} (matrices and embedding only) |",
        f"| grad clip | {args.grad_clip} |",
        f"| seed | {args.seed} |",
        "| precision | float32, CPU, `torch.set_num_threads(1)` |",
        "",
        "## Results",
        "",
        f"- Wall time of the training loop: {result.train_seconds:.0f} s ({result.train_seconds / 60:.1f} min).",
        f"- Final train loss (mean of last 50 steps): {result.final_train_loss_running:.4f} nats/byte.",
        f"- Final train loss (1024 evenly spaced {args.seq_len}-byte train windows): "
        f"{result.final_train_loss_eval:.4f} nats/byte ({result.final_train_loss_eval * bpb:.3f} bits/byte).",
        f"- Held-out loss (all non-overlapping {args.seq_len}-byte windows of the held-out files): "
        f"{result.final_heldout_loss:.4f} nats/byte ({result.final_heldout_loss * bpb:.3f} bits/byte).",
        f"- Folder size (weights, configs, tokenizer, this file): {folder_size(out) / 1e6:.2f} MB.",
        "",
        "Loss curve (running mean of the last 50 train steps; held-out on 64 windows):",
        "",
        "| step | lr | train | held-out |",
        "|---:|---:|---:|---:|",
    ]
    every = max(1, len(result.log) // 24)
    shown = [row for i, row in enumerate(result.log) if i % every == 0 or i == len(result.log) - 1]
    for step, lr, running, heldout in shown:
        lines.append(f"| {step} | {lr:.2e} | {running:.4f} | {'' if heldout is None else f'{heldout:.4f}'} |")
    lines += [
        "",
        "## Versions",
        "",
        f"- Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, "
        f"{platform.machine()} {platform.system()}.",
        "",
        "## Samples",
        "",
        "From the saved checkpoint via `LlamaForCausalLM.from_pretrained(...).generate(...)`, 200 new bytes",
        "at most, stopping at EOS (shown as `<EOS>`). Sampled: temperature 0.8, top-p 0.95, "
        f"`torch.manual_seed({args.seed})` before each call. Trailing whitespace on each line trimmed.",
        "",
    ]
    for prompt, mode, text in samples:
        body = "\n".join(line.rstrip() for line in text.rstrip("\n").splitlines())
        lines += [f"### {mode}, prompt `{prompt!r}`", "", "````text", body, "````", ""]
    (out / "TRAINING.md").write_text("\n".join(lines), encoding="utf-8")
