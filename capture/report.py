"""What capture did, per (kind, bucket): a table, a JSON file, and a check against a recorded baseline.

`static-decode capture-report` compiles every bucket of a model's steps and prints one row per pair: compile
(and capture) seconds, graphs, graph breaks, recompiles, cudagraph skips and, on CUDA, the device memory the
capture reserved (graph pool included). `--json PATH` writes it; `--check BASELINE.json` exits non-zero
when the pairs, or the graphs / graph breaks / cudagraph skips / eager fallback of any pair, differ from the
baseline. Seconds, memory and recompiles are reported, never compared (they depend on the machine and the
torch release). Under torchrun it reports a tensor-parallel rank's steps (all-reduces inside), and the "runs"
column says "eager (why)" for a kind whose compile or capture failed and fell back.
"""

from __future__ import annotations

import json
import sys
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
    graphs: int  # FX graphs compiled (1 for a healthy pair)
    graph_breaks: int  # graph breaks (0; fullgraph=True turns one into an error)
    recompiles: int  # dynamo's recompiles (each bucket after a kind's first is one; informational)
    cudagraph_skips: int  # reduce-overhead fell back to no CUDA graph (0 on CUDA; CPU never uses them)
    pool_bytes: int | None = None  # CUDA: allocator memory reserved during the capture; None elsewhere
    fallback: str = ""  # why this kind runs its eager step instead ("" = compiled; see StepRegistry fallback)


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

    @property
    def fallbacks(self) -> dict[str, str]:
        """Kinds that run eagerly, with the reason."""
        return {r.kind: r.fallback for r in self.records if r.fallback}

    def summary(self) -> str:
        eager = f", {len(self.fallbacks)} kind(s) fell back to eager" if self.fallbacks else ""
        return (
            f"{len(self.records)} (kind, bucket) pairs in {self.seconds:.1f} s: {self.graphs} graphs, "
            f"{self.graph_breaks} graph breaks, {self.cudagraph_skips} cudagraph skips{eager} ({self.settings} "
            f"on {self.device})"
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
        columns = ("kind", "bucket", "compile s", "graphs", "breaks", "recompiles", "cg skips", "pool MiB", "runs")
        for name in columns:
            t.add_column(name, justify="left" if name in ("kind", "runs") else "right", no_wrap=name != "runs")
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
                f"eager ({r.fallback})" if r.fallback else "compiled",
            )
        t.caption = self.summary()
        return t


# ---- `static-decode capture-report` ---------------------------------------------------------------------------
def int_list(text: str) -> tuple[int, ...]:
    """argparse type for comma-separated ints (also used by `static-decode bench`)."""
    import argparse

    try:
        values = tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from e
    if not values:
        raise argparse.ArgumentTypeError("expected at least one int")
    return values


def build_report(
    model: Any,
    *,
    max_len: int,
    chunk_size: int,
    batch: int = 1,
    buckets: Any = None,
    kinds: tuple[str, ...] | None = None,
    settings: Any = None,
    progress: bool = True,
) -> CaptureReport:
    """Compile every (kind, bucket) of a Generator over `model` and return the records (model: a Llama)."""
    from capture.settings import CaptureOptions
    from static_decode.generator import Generator

    opts = CaptureOptions(buckets=buckets, settings=settings, warm_up="lazy", progress=progress)
    gen = Generator(model, max_len=max_len, chunk_size=chunk_size, batch=batch, compile=True, capture=opts)
    registry = gen._registry
    report = registry.warm_up(registry.pairs(kinds), progress=progress)
    report.meta |= {
        "max_len": max_len, "chunk_size": chunk_size, "batch": batch, "ladder": list(registry.ladder.lengths),
        "kinds": list(kinds or registry.kinds), "dtype": str(model.dtype).removeprefix("torch."),
    }
    return report


def run_capture_report(args: Any) -> int:
    """The CLI command: build, print the table, optionally write JSON and check against a baseline."""
    from rich.console import Console

    from static_decode.cli import default_model_path
    from static_decode.loading import load_model

    path = args.model or default_model_path()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    launch = getattr(args, "launch", None)  # under torchrun: this rank's shard, device and collectives
    device = launch.device if launch else (args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    baseline = CaptureReport.read_json(args.check) if args.check else None  # a bad baseline fails first
    model = load_model(path, dtype=args.dtype, device=device, **({"tp": launch.tp} if launch else {}))
    report = build_report(
        model, max_len=args.max_len, chunk_size=args.chunk_size, batch=args.batch, buckets=args.buckets,
        kinds=args.kinds, progress=not args.quiet,
    )
    report.meta["model"] = "embedded default" if args.model is None else str(path)
    if launch is not None:
        report.meta["tensor_parallel"] = {"world": launch.tp.world, "backend": launch.backend}
    Console(width=max(100, Console().width)).print(report.table())  # rank 0's (the others print to /dev/null)
    if args.json and (launch is None or launch.is_main):
        report.write_json(args.json)
    if baseline is None:
        return 0
    diffs = report.differences(baseline)
    if (baseline.settings, baseline.meta.get("torch")) != (report.settings, torch.__version__):
        print(f"capture-report --check: note: baseline made with {baseline.settings}, torch "
              f"{baseline.meta.get('torch')}; this run: {report.settings}, torch {torch.__version__}", file=sys.stderr)
    for line in diffs:
        print(f"capture-report --check {args.check}: {line}", file=sys.stderr)
    if diffs:
        return 1
    print(f"capture-report --check {args.check}: graphs, graph breaks, cudagraph skips and fallbacks match",
          file=sys.stderr)
    return 0


def add_parser(subparsers: Any) -> None:
    """Register `capture-report` with the static-decode CLI (static_decode/cli.py's COMMAND_MODULES)."""
    from pathlib import Path as _Path

    p = subparsers.add_parser("capture-report", help="compile every (kind, bucket) and report graphs, breaks, skips")
    p.add_argument("--model", type=_Path, default=None, help="checkpoint dir (default: embedded model)")
    p.add_argument("--max-len", type=int, default=4096, help="cache capacity (the ladder's last bucket)")
    p.add_argument("--chunk-size", type=int, default=64, help="prompt slots per prefill step")
    p.add_argument("--batch", type=int, default=1, help="cache rows")
    p.add_argument("--buckets", type=int_list, default=None, help="read lengths, e.g. 256,1024,4096 (default ladder)")
    p.add_argument("--kinds", type=lambda s: tuple(k for k in s.split(",") if k), default=None,
                   help="step kinds to compile, e.g. prefill,first_greedy,decode_greedy (default: all)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--json", type=_Path, default=None, help="write the report as JSON to this path")
    p.add_argument("--check", type=_Path, default=None, help="baseline JSON: exit 1 if graphs/breaks/skips differ")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run_capture_report, distributed=True)
