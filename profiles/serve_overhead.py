"""What `static-decode serve` adds over a direct `Generator.generate`: per decoded token and per request.

    python profiles/serve_overhead.py --model DIR [--context 1024] [--new-tokens 128] [--rounds 8] [--compile]
                                      [--dtype bfloat16] [--threads N] [--json OUT]

The server runs as a subprocess (`static-decode serve`, the same generator settings); this process holds the
direct Generator and the HTTP client. Each round sends one greedy request of `--context` prompt token ids and
`--new-tokens` new ones (`ignore_eos`, so every request decodes the same count) to the server, streamed, and
runs the same request on the direct generator; the order alternates round by round, and each round shifts the
prompt window over the text so that the server's prefix cache reuses nothing (both prefill the whole prompt).

Per token: the direct generator's decode time per token (GenerationStats: first token to last on the host)
against the client's view of the stream (first text event to last, over new_tokens - 1 tokens); the server's
own report (usage.ms_per_token) beside it. Per request: wall time from the call to the last token (direct) or
to `data: [DONE]` (server). Medians over the rounds (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402

from capture import CaptureOptions  # noqa: E402
from static_decode import Generator, load_model  # noqa: E402
from static_decode.checkpoints.loading import load_tokenizer  # noqa: E402
from static_decode.commands.args import default_threads  # noqa: E402
from static_decode.steps.functions import GREEDY_KINDS  # noqa: E402

SHIFT = 97  # prompt-window shift per round: no two rounds share a first token position's content


def start_server(args: argparse.Namespace, max_len: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "static_decode", "serve", "--model", str(args.model), "--port", "0",
           "--max-len", str(max_len), "--capture-kinds", "greedy", "--queue", "1"]
    cmd += ["--compile"] if args.compile else []
    cmd += ["--dtype", args.dtype] if args.dtype else []
    cmd += ["--threads", str(args.threads)]  # the same as here: two torch threads where one is free collapse
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if " on http://" not in line:
        proc.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    return proc, line.split(" on ", 1)[1].split()[0]


def via_server(url: str, prompt: list[int], new: int) -> dict[str, float]:
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    first = last = None
    usage = None
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
    done = time.perf_counter()
    assert usage is not None and usage["completion_tokens"] == new, usage
    return {"request_ms": 1e3 * (done - t0), "ms_per_token": 1e3 * (last - first) / (new - 1),
            "server_ms_per_token": usage["ms_per_token"], "server_prefill_ms": usage["prefill_ms"]}


def direct(gen: Generator, prompt: list[int], new: int) -> dict[str, float]:
    t0 = time.perf_counter()
    out = gen.generate(prompt, new, stop_at_eos=False)
    done = time.perf_counter()
    assert len(out) == new
    return {"request_ms": 1e3 * (done - t0), "ms_per_token": gen.stats.ms_per_step,
            "prefill_ms": 1e3 * gen.stats.prefill_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads here and in the server (default: serve's default, every core but one)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.threads = args.threads or default_threads()
    torch.set_num_threads(args.threads)
    max_len = args.context + args.new_tokens
    text = "".join(f.read_text() for f in sorted((ROOT / "static_decode").rglob("*.py")))
    ids = load_tokenizer(args.model).encode(text).ids
    need = args.context + SHIFT * args.rounds
    if len(ids) < need:
        raise SystemExit(f"the text has {len(ids)} tokens, {need} needed")
    proc, url = start_server(args, max_len)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a killed run still stops its server (finally below)
    try:
        model = load_model(args.model, dtype=args.dtype)
        capture = CaptureOptions(kinds=GREEDY_KINDS) if args.compile else None
        gen = Generator(model, max_len=max_len, batch=1, compile=args.compile, capture=capture)
        if args.compile:
            gen.warm_up(GREEDY_KINDS, progress=False)
        warm = ids[-args.context :]
        via_server(url, warm, args.new_tokens)  # both warm: first calls, allocations
        direct(gen, warm, args.new_tokens)
        rows = []
        for r in range(args.rounds):
            prompt = ids[SHIFT * r : SHIFT * r + args.context]
            if r % 2 == 0:
                s, d = via_server(url, prompt, args.new_tokens), direct(gen, prompt, args.new_tokens)
            else:
                d, s = direct(gen, prompt, args.new_tokens), via_server(url, prompt, args.new_tokens)
            rows.append({"server": s, "direct": d})
            print(f"round {r}: server {s['ms_per_token']:.3f} ms/token (its own {s['server_ms_per_token']:.3f}), "
                  f"{s['request_ms']:.1f} ms/request; direct {d['ms_per_token']:.3f} ms/token, "
                  f"{d['request_ms']:.1f} ms/request", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    def med(side: str, key: str) -> float:
        return statistics.median(row[side][key] for row in rows)

    summary = {
        "direct_ms_per_token": med("direct", "ms_per_token"),
        "server_ms_per_token_client": med("server", "ms_per_token"),
        "server_ms_per_token_own": med("server", "server_ms_per_token"),
        "direct_request_ms": med("direct", "request_ms"),
        "server_request_ms": med("server", "request_ms"),
        "direct_prefill_ms": med("direct", "prefill_ms"),
        "server_prefill_ms": med("server", "server_prefill_ms"),
        # per round, then the median: the pairs ran back to back, in the same phase of the shared machine
        "per_token_overhead_pct": statistics.median(
            100 * (row["server"]["ms_per_token"] / row["direct"]["ms_per_token"] - 1) for row in rows),
        "per_request_overhead_ms": statistics.median(
            row["server"]["request_ms"] - row["direct"]["request_ms"] for row in rows),
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"settings": settings, "torch": torch.__version__,
                                         "threads": torch.get_num_threads(), "summary": summary, "rounds": rows},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
