"""Write a copy of a Llama checkpoint whose every layer attends within a sliding window: the same weights (linked,
not copied), its config rewritten as Mistral's (`MistralForCausalLM`, `sliding_window` W).

Why: the windowed-decode measurement (docs/performance.md) needs a real model whose layers all have a window, so a
decode step's attention cost stops growing at W; SmolLM2 with a window of 512 is that model, its text aside.

    python profiles/windowed.py --source /tmp/smollm2 --out /tmp/smolwin --window 512
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MISTRAL = "MistralForCausalLM"


def write(source: Path, out: Path, window: int) -> Path:
    """out/ holds source's files, each a symlink to the original, but config.json: the source's as Mistral with
    `sliding_window` = window. A source that is not a Llama checkpoint, or a window < 1, is refused naming it."""
    if window < 1:
        raise ValueError(f"--window must be >= 1, got {window}")
    config = json.loads((source / "config.json").read_text())
    arch = config.get("architectures") or []
    if arch not in (["LlamaForCausalLM"], [MISTRAL]):
        raise ValueError(f"{source}/config.json: architectures {arch}; expected ['LlamaForCausalLM']")
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.name != "config.json":
            link = out / f.name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(f.resolve())
    config |= {"architectures": [MISTRAL], "model_type": "mistral", "sliding_window": window}
    config.pop("use_sliding_window", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, required=True, help="a Llama save_pretrained directory")
    p.add_argument("--out", type=Path, required=True, help="the directory to write")
    p.add_argument("--window", type=int, default=512, help="every layer's sliding window (default 512)")
    args = p.parse_args(argv)
    if args.out.resolve() == args.source.resolve():
        raise SystemExit("--out must differ from --source")
    if args.out.exists() and not args.out.is_dir():
        raise SystemExit(f"--out {args.out} exists and is not a directory")
    print(write(args.source, args.out, args.window))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
