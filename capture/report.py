"""What capture did, per (kind, bucket): records, a table, a JSON file, and a check against a recorded baseline.

Per pair: compile (and capture) seconds, graphs, graph breaks, recompiles, cudagraph skips and, on CUDA, the
device memory the capture reserved (graph pool included). Per kind (`graphs_per_kind`, the summary line): the graphs
compiled over its buckets, 1 with a symbolic read length (a pair that reused it shows 0 graphs), 1 per bucket with a
static one. `differences()` compares the pairs and the graphs /
graph breaks / cudagraph skips / eager fallback of each with a baseline; seconds, memory and recompiles are
reported, never compared (they depend on the machine and the torch release). The `static-decode
capture-report` command (static_decode/commands/capture_report.py) prints, writes and checks these.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

CHECKED_FIELDS = ("graphs", "graph_breaks", "cudagraph_skips", "fallback")  # what --check compares per pair


@dataclass(frozen=True)
class CaptureRecord:
    """Compile work of one (kind, read_len) pair: its first call(s), timed and counted."""

    kind: str  # step kind ("prefill", "decode", ...)
    read_len: int  # the bucket (0 for kinds that read no cache)
    seconds: float  # wall time of the warm-up calls (compile, and capture under CUDA graphs)
    graphs: int  # FX graphs compiled: 1 where the pair compiled, 0 where it reused its kind's symbolic graph
    graph_breaks: int  # graph breaks (0; fullgraph=True turns one into an error)
    recompiles: int  # dynamo's recompiles (static: each bucket after a kind's first is one; informational)
    cudagraph_skips: int  # reduce-overhead fell back to no CUDA graph (0 on CUDA; CPU never uses them)
    pool_bytes: int | None = None  # CUDA: allocator memory reserved during the capture; None elsewhere
    fallback: str = ""  # why this kind runs its eager step instead ("" = compiled; see StepRegistry fallback)
    # Layer-region graphs (capture.regions) this pair's first calls compiled, apart from `graphs`: a region is
    # compiled once per chunk shape for every kind, so whichever kind runs a shape first pays it. Not checked
    # per pair against a baseline (it depends on the order the kinds warm up); `graphs` is the step's own.
    region_graphs: int = 0


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
        """Every graph compiled: the steps' own and the layer regions'."""
        return sum(r.graphs + r.region_graphs for r in self.records)

    @property
    def region_graphs(self) -> int:
        return sum(r.region_graphs for r in self.records)

    @property
    def graph_breaks(self) -> int:
        return sum(r.graph_breaks for r in self.records)

    @property
    def cudagraph_skips(self) -> int:
        return sum(r.cudagraph_skips for r in self.records)

    @property
    def fallbacks(self) -> dict[str, str]:
        """Kinds that run eagerly, with the reason."""
        return {r.kind: r.fallback for r in self.records if r.fallback}

    def graphs_per_kind(self) -> dict[str, tuple[int, int]]:
        """kind -> (graphs compiled, buckets recorded), in record order: compiles per kind at a glance."""
        out: dict[str, tuple[int, int]] = {}
        for r in self.records:
            graphs, buckets = out.get(r.kind, (0, 0))
            out[r.kind] = (graphs + r.graphs, buckets + 1)
        return out

    def summary(self) -> str:
        eager = f", {len(self.fallbacks)} kind(s) fell back to eager" if self.fallbacks else ""
        per_kind = ", ".join(
            f"{kind} {g} for {b} bucket{'s' if b != 1 else ''}" for kind, (g, b) in self.graphs_per_kind().items()
        )
        per_kind = f" ({per_kind})" if per_kind else ""
        graphs = f"{self.graphs} graphs{per_kind}"
        if self.region_graphs:
            r = self.region_graphs
            graphs = f"{self.graphs - r} step graphs{per_kind} + {r} layer-region graph{'s' if r != 1 else ''}"
        return (
            f"{len(self.records)} (kind, bucket) pairs in {self.seconds:.1f} s: {graphs}, "
            f"{self.graph_breaks} graph breaks, {self.cudagraph_skips} cudagraph skips{eager} "
            f"({self.settings} on {self.device})"
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
        known = {"device", "settings", "seconds", "records"}  # the rest (torch, model, ladder, ...) is meta
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
        """Human-readable differences in pairs and CHECKED_FIELDS from `baseline`; empty when they agree.

        Only the kinds this report compiled are compared (a run of the greedy kinds checks against a baseline of
        all kinds); within them, a pair missing on either side is a difference.
        """
        mine = {(r.kind, r.read_len): r for r in self.records}
        kinds = {r.kind for r in self.records}
        theirs = {(r.kind, r.read_len): r for r in baseline.records if r.kind in kinds}
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
        columns = ("kind", "bucket", "compile s", "graphs", "regions", "breaks", "recompiles", "cg skips", "pool MiB",
                   "runs")
        for name in columns:
            t.add_column(name, justify="left" if name in ("kind", "runs") else "right", no_wrap=name != "runs")
        for r in self.records:
            pool = "-" if r.pool_bytes is None else f"{r.pool_bytes / 2**20:.1f}"
            t.add_row(
                r.kind,
                str(r.read_len),
                f"{r.seconds:.2f}",
                str(r.graphs),
                str(r.region_graphs),
                str(r.graph_breaks),
                str(r.recompiles),
                str(r.cudagraph_skips),
                pool,
                f"eager ({r.fallback})" if r.fallback else "compiled",
            )
        t.caption = self.summary()
        return t
