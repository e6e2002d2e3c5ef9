"""What capture did, per (kind, bucket): a table, a JSON file, and a check against a recorded baseline.

`static-decode capture-report` compiles every bucket of a model's steps and prints one row per pair: compile
(and capture) seconds, graphs, graph breaks, recompiles, cudagraph skips and, on CUDA, the device memory the
capture reserved (graph pool included). `--json PATH` writes it; `--check BASELINE.json` exits non-zero
when the pairs, or the graphs / graph breaks / cudagraph skips of any pair, differ from the baseline. Seconds,
memory and recompiles are reported, never compared (they depend on the machine and the torch release).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

CHECKED_FIELDS = ("graphs", "graph_breaks", "cudagraph_skips")  # what --check compares per pair


@dataclass(frozen=True)
class CaptureRecord:
    """Compile work of one (kind, read_len) pair: its first call(s), timed and counted."""

    kind: str  # step kind ("prefill", "decode", ...)
    read_len: int  # the bucket (0 for kinds that read no cache)
    seconds: float  # wall time of the warm-up calls (compile, and capture under CUDA graphs)
    graphs: int  # FX graphs compiled (1 for a healthy pair)
    graph_breaks: int  # graph breaks (0; fullgraph=True turns one into an error)
    recompiles: int  # dynamo's recompiles (each bucket after a kind's first is one; informational)
    cudagraph_skips: int  # reduce-overhead fell back to no CUDA graph (0 on CUDA; CPU never uses them)
    pool_bytes: int | None = None  # CUDA: allocator memory reserved during the capture; None elsewhere


@dataclass
class CaptureReport:
    """Records of a warm-up (or of a whole capture-report run) plus where they were made."""

    records: list[CaptureRecord]
    seconds: float  # total wall time
    settings: str = ""  # CompileSettings.describe()
    device: str = ""
    meta: dict[str, Any] = field(
        default_factory=dict
    )  # model, max_len, ladder, ... (capture-report fills it)

    @property
    def graphs(self) -> int:
        return sum(r.graphs for r in self.records)

    @property
    def graph_breaks(self) -> int:
        return sum(r.graph_breaks for r in self.records)

    @property
    def cudagraph_skips(self) -> int:
        return sum(r.cudagraph_skips for r in self.records)

    def summary(self) -> str:
        return (
            f"{len(self.records)} (kind, bucket) pairs in {self.seconds:.1f} s: {self.graphs} graphs, "
            f"{self.graph_breaks} graph breaks, {self.cudagraph_skips} cudagraph skips ({self.settings} on "
            f"{self.device})"
        )

    # ---- JSON ---------------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "torch": torch.__version__,
            "device": self.device,
            "settings": self.settings,
            "seconds": round(self.seconds, 3),
            **self.meta,
            "records": [asdict(r) | {"seconds": round(r.seconds, 3)} for r in self.records],
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CaptureReport:
        known = {"torch", "device", "settings", "seconds", "records"}
        try:
            records = [CaptureRecord(**r) for r in data["records"]]
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a capture report (records missing or malformed): {e}") from e
        return cls(
            records=records,
            seconds=float(data.get("seconds", 0.0)),
            settings=str(data.get("settings", "")),
            device=str(data.get("device", "")),
            meta={k: v for k, v in data.items() if k not in known},
        )

    @classmethod
    def read_json(cls, path: str | Path) -> CaptureReport:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read capture baseline {path}: {e}") from e
        return cls.from_json(data)

    # ---- the baseline check -------------------------------------------------------------------------------
    def differences(self, baseline: CaptureReport) -> list[str]:
        """Human-readable differences in pairs and CHECKED_FIELDS from `baseline`; empty when they agree."""
        mine = {(r.kind, r.read_len): r for r in self.records}
        theirs = {(r.kind, r.read_len): r for r in baseline.records}
        out = [
            f"pair {p} is in the baseline but was not compiled" for p in sorted(theirs.keys() - mine.keys())
        ]
        out += [
            f"pair {p} was compiled but is not in the baseline" for p in sorted(mine.keys() - theirs.keys())
        ]
        for p in sorted(mine.keys() & theirs.keys()):
            for name in CHECKED_FIELDS:
                now, then = getattr(mine[p], name), getattr(theirs[p], name)
                if now != then:
                    out.append(f"{p[0]} @ {p[1]}: {name} = {now}, baseline {then}")
        return out

    # ---- the table ----------------------------------------------------------------------------------------
    def table(self) -> Any:
        from rich.table import Table

        t = Table(title=f"capture: {self.settings} on {self.device}, torch {torch.__version__}")
        for name in ("kind", "bucket", "compile s", "graphs", "breaks", "recompiles", "cg skips", "pool MiB"):
            t.add_column(name, justify="left" if name == "kind" else "right")
        for r in self.records:
            pool = "-" if r.pool_bytes is None else f"{r.pool_bytes / 2**20:.1f}"
            t.add_row(
                r.kind,
                str(r.read_len),
                f"{r.seconds:.2f}",
                str(r.graphs),
                str(r.graph_breaks),
                str(r.recompiles),
                str(r.cudagraph_skips),
                pool,
            )
        t.caption = self.summary()
        return t
