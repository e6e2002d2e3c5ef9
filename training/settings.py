"""A training run's arguments and what it measured."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class TrainResult:
    steps: int
    train_seconds: float
    final_train_loss_running: float
    final_train_loss_eval: float
    final_heldout_loss: float
    log: list[tuple[int, float, float, float | None]] = field(default_factory=list)
