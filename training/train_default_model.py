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
import math
import os
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from corpus import (
    EOS_ID,
    PROMPTS,
    VOCAB_SIZE,
    Corpus,
    build_byte_tokenizer,
    build_corpus,
    check_byte_tokenizer,
)
from report import folder_size, write_training_md
from settings import TrainArgs, TrainResult
from tokenizers import Tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

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
