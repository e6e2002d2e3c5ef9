"""Train static-decode's tiny embedded default model.

What this does
--------------
The package ships a very small byte-level Llama model in this folder so that the CLI, the examples and
the tests have a real, self-contained checkpoint to decode with: no download, no network, a few MB of
package data. This script is how that checkpoint was made, so it can be reproduced or retrained.

1. Corpus: every ``.py`` file of the Python standard library of the interpreter running this script
   (``sysconfig.get_paths()["stdlib"]``), leaving out ``site-packages``/``dist-packages``, ``test``/``tests``
   folders, ``idlelib`` and ``lib2to3``. Files are read as raw bytes in sorted (POSIX relative path)
   order and each is followed by one NUL byte, which is also the model's EOS token, so the model learns
   to end a file. Every 50th file (2%) is held out for evaluation. The Python source is distributed under
   the PSF License Agreement, which permits use, modification and redistribution of derived works.
2. Model: transformers' own ``LlamaForCausalLM`` (so the saved files are exactly what ``save_pretrained``
   writes): vocab 256 (token id = byte value), hidden 128, 4 layers, 4 query heads sharing 2 KV heads
   (grouped-query attention, G = 2), head_dim 32, SwiGLU MLP of 384, tied embeddings, RoPE theta 10000.
   About 0.82 M parameters, 3.3 MB in float32.
3. Training: random windows of ``--seq-len`` bytes, AdamW, linear warmup then cosine decay, gradient
   clipping, one CPU thread, fixed seed. With ``--minutes`` the number of steps is fixed once, from the
   step time measured during warmup, so that the LR schedule completes inside the budget; the step count
   actually used is recorded, and ``--steps N`` reproduces that run.
4. Output (``--out``): ``config.json``, ``generation_config.json`` (eos 0), ``model.safetensors``, a
   byte-level ``tokenizer.json`` (token id = byte value, decodes back to text) and ``TRAINING.md`` with the
   corpus, command, hyperparameters, losses, versions and greedy/sampled samples.

Usage::

    python training/train_default_model.py --out static_decode/default_model --minutes 25
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import platform
import shlex
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

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


# -------------------------------------------------------------------------------------------- model


def model_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=None,
        attention_bias=False,
        mlp_bias=False,
    )


# ----------------------------------------------------------------------------------------- training


@dataclass
class TrainArgs:
    out: str
    steps: int | None
    minutes: float
    seed: int
    batch_size: int
    seq_len: int
    lr: float
    min_lr_ratio: float
    warmup: int
    weight_decay: float
    grad_clip: float
    log_every: int
    eval_every: int


def lr_at(step: int, total: int, args: TrainArgs) -> float:
    """Linear warmup to ``args.lr``, then cosine decay to ``args.lr * args.min_lr_ratio`` at ``total``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def random_batch(data: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    return data[idx].long()


def lm_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE).float(), windows[:, 1:].reshape(-1))


@torch.no_grad()
def eval_loss(model: LlamaForCausalLM, data: torch.Tensor, seq_len: int, max_windows: int | None) -> float:
    """Mean next-byte loss (nats) over non-overlapping windows, evenly spread when ``max_windows`` is set."""
    n = (data.numel() - 1) // seq_len
    starts = torch.arange(n) * seq_len
    if max_windows is not None and n > max_windows:
        starts = starts[torch.linspace(0, n - 1, max_windows).long()]
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for chunk in starts.split(32):
        windows = data[chunk[:, None] + torch.arange(seq_len + 1)].long()
        total += lm_loss(model, windows).item() * windows.shape[0]
        count += windows.shape[0]
    model.train(was_training)
    return total / count


@dataclass
class TrainResult:
    steps: int
    train_seconds: float
    final_train_loss_running: float
    final_train_loss_eval: float
    final_heldout_loss: float
    log: list[tuple[int, float, float, float | None]] = field(default_factory=list)


def train(model: LlamaForCausalLM, corpus: Corpus, args: TrainArgs) -> TrainResult:
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    train_data = torch.frombuffer(bytearray(corpus.train), dtype=torch.uint8)
    heldout_data = torch.frombuffer(bytearray(corpus.heldout), dtype=torch.uint8)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    budget_s = args.minutes * 60.0
    total = args.steps if args.steps is not None else None
    model.train()
    t0 = time.perf_counter()
    step_times: list[float] = []
    recent: list[float] = []
    log: list[tuple[int, float, float, float | None]] = []
    step = 0
    while total is None or step < total:
        ts = time.perf_counter()
        lr = lr_at(step, total if total is not None else 10**9, args)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = lm_loss(model, random_batch(train_data, args.batch_size, args.seq_len, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        step_times.append(time.perf_counter() - ts)
        recent = (recent + [loss.item()])[-50:]

        if total is None and step == args.warmup:
            # Fix the step count once, from the measured step time, so the schedule ends inside the budget.
            per_step = sum(step_times[args.warmup // 2 :]) / len(step_times[args.warmup // 2 :])
            elapsed = time.perf_counter() - t0
            total = max(step + 1, step + int((budget_s - elapsed) / (per_step * 1.03)))
            print(f"[calibrate] {per_step:.3f} s/step -> total steps {total}", flush=True)

        heldout = None
        if args.eval_every and step % args.eval_every == 0:
            heldout = eval_loss(model, heldout_data, args.seq_len, max_windows=64)
        if step % args.log_every == 0 or heldout is not None or step == total:
            running = sum(recent) / len(recent)
            log.append((step, lr, running, heldout))
            msg = f"step {step:5d}/{total or '?'}  lr {lr:.2e}  loss {running:.4f}"
            if heldout is not None:
                msg += f"  heldout {heldout:.4f}"
            print(msg + f"  {time.perf_counter() - t0:7.1f}s", flush=True)

    train_seconds = time.perf_counter() - t0
    print("[eval] final losses ...", flush=True)
    final_heldout = eval_loss(model, heldout_data, args.seq_len, max_windows=None)
    final_train = eval_loss(model, train_data, args.seq_len, max_windows=1024)
    return TrainResult(
        steps=step,
        train_seconds=train_seconds,
        final_train_loss_running=sum(recent) / len(recent),
        final_train_loss_eval=final_train,
        final_heldout_loss=final_heldout,
        log=log,
    )


# --------------------------------------------------------------------------------------- generation


def generate_samples(out: Path, seed: int, max_new_tokens: int = 200) -> list[tuple[str, str, str]]:
    """Reload the saved checkpoint and tokenizer from ``out``; greedy and sampled text per prompt."""
    model = LlamaForCausalLM.from_pretrained(out).eval()
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    samples = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids])
        for mode in ("greedy", "sampled"):
            torch.manual_seed(seed)
            kwargs: dict[str, object] = {"do_sample": False}
            if mode == "sampled":
                kwargs = {"do_sample": True, "temperature": 0.8, "top_k": 0, "top_p": 0.95}
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=max_new_tokens, **kwargs)[0, ids.shape[1] :].tolist()
            eos = EOS_ID in gen
            if eos:
                gen = gen[: gen.index(EOS_ID)]
            samples.append((prompt, mode, prompt + tok.decode(gen) + ("<EOS>" if eos else "")))
    return samples


# ---------------------------------------------------------------------------------------- reporting


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


# --------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "static_decode" / "default_model"),
                   help="output folder")
    p.add_argument("--steps", type=int, default=None, help="exact number of steps (overrides --minutes)")
    p.add_argument("--minutes", type=float, default=25.0, help="training-loop time budget when --steps is unset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=250)
    ns = p.parse_args(argv)
    return TrainArgs(**vars(ns))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python " + shlex.join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]) if argv is None else ""
    print(f"args: {asdict(args)}", flush=True)

    tok = build_byte_tokenizer()
    check_byte_tokenizer(tok)

    corpus = build_corpus()
    print(
        f"corpus: {len(corpus.train_files)} train files ({len(corpus.train):,} B), "
        f"{len(corpus.heldout_files)} held-out files ({len(corpus.heldout):,} B), "
        f"{len(corpus.skipped_files)} skipped",
        flush=True,
    )

    config = model_config()
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters, attn {model.config._attn_implementation}", flush=True)

    result = train(model, corpus, args)
    print(
        f"done: {result.steps} steps in {result.train_seconds:.0f} s; "
        f"train {result.final_train_loss_eval:.4f} held-out {result.final_heldout_loss:.4f}",
        flush=True,
    )

    model.generation_config = GenerationConfig(eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        (out / name).chmod(0o644)
    check_byte_tokenizer(Tokenizer.from_file(str(out / "tokenizer.json")))

    samples = generate_samples(out, args.seed)
    for prompt, mode, text in samples:
        print(f"--- {mode} {prompt!r}\n{text}\n", flush=True)
    write_training_md(out, corpus, config, n_params, args, result, samples, command)
    print(f"wrote {out}; {folder_size(out) / 1e6:.2f} MB", flush=True)


if __name__ == "__main__":
    main()
