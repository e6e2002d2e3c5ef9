"""Speculative decoding on a real model: prompt lookup against plain compiled greedy decode, side by side.

    .venv/bin/python profiles/speculation.py --model DIR [--configs 4:3,8:2] [--repeats 3] [--out FILE.json]

DIR is a save_pretrained checkpoint with tokenizer.json and a chat template (profiles/smollm2.py writes
SmolLM2-135M-Instruct). Two chat prompts: an input-grounded edit (code in the prompt, "add a docstring and show
the whole function": the reply quotes the input, which prompt lookup drafts from) and free generation (a short
story: little to look up). For each prompt and system, greedy, batch 1, compiled (the capture layer's CPU
defaults), EOS ends the reply:

* the output of every speculative system must equal plain decode's token for token (checked; a mismatch fails);
* tokens/s of the decode phase (tokens after the first / the time after the first) and end to end, medians over
  `--repeats` rounds with the systems interleaved in each round (a busy neighbour slows all of them alike);
* accepted tokens per verify step next to its ceiling: prompt lookup simulated in plain Python over the prompt
  plus plain decode's own output (what a verify step could accept at best with this draft rule);
* the cost of one verify step of K + 1 slots against a one-token step (bare compiled steps, no read-back).

Not a test: timings decide nothing here; the JSON and the printed table go to profiles/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from capture import CaptureOptions  # noqa: E402
from static_decode import Generator, PromptLookup, load_model, load_tokenizer  # noqa: E402
from static_decode.steps.functions import GREEDY_KINDS  # noqa: E402
from static_decode.text.chat_template import load_chat_template  # noqa: E402

CODE = '''def merge_intervals(intervals):
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged
'''
PROMPTS = {
    "edit": f"Add a docstring to this Python function and show the whole function:\n\n{CODE}",
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def simulated_lookup(prompt: list[int], output: list[int], tokens: int, ngram: int) -> float:
    """Tokens per verify step that greedy prompt lookup (static_decode.steps.verify.lookup_draft's rule) reaches when
    the model's output is `output`: the ceiling of the speculative run, whatever its step costs."""
    hist = list(prompt) + output[:1]
    i, steps = 1, 0
    while i < len(output):
        L = len(hist)
        draft = [hist[-1]] * tokens
        for j in range(L - ngram - 1, -1, -1):
            if hist[j : j + ngram] == hist[L - ngram :]:
                period = L - ngram - j
                draft = [hist[j + ngram + k % period] for k in range(tokens)]
                break
        accepted = 0
        while accepted < tokens and i + accepted < len(output) and draft[accepted] == output[i + accepted]:
            accepted += 1
        take = min(accepted + 1, len(output) - i)
        hist += output[i : i + take]
        i += take
        steps += 1
    return (len(output) - 1) / max(steps, 1)


def bare_step_ms(gen: Generator, kind: str, length: int, steps: int = 20) -> float:
    """ms per step of `kind` back to back at read bucket of `length`, every row done (same work, no writes)."""
    bucket = gen.read_len(length)
    fn = gen.step_fn(kind, bucket)
    args = (gen.model, gen.cache, gen.bufs, bucket)
    gen.bufs.done.fill_(True)
    with torch.no_grad():
        fn(*args)
        t = time.perf_counter()
        for _ in range(steps):
            fn(*args)
        return 1e3 * (time.perf_counter() - t) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint dir with tokenizer.json and a chat template")
    ap.add_argument("--configs", default="4:3,8:3", help="prompt lookup TOKENS:NGRAM pairs, comma-separated")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--table", type=Path, default=None, help="print the table of an earlier --out JSON and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model)
    tok = load_tokenizer(args.model)
    template = load_chat_template(args.model)
    prompts = {
        name: tok.encode(template.render([{"role": "user", "content": text}], add_generation_prompt=True),
                         add_special_tokens=False).ids
        for name, text in PROMPTS.items()
    }
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    systems: dict[str, Generator] = {}
    t0 = time.perf_counter()
    systems["plain"] = Generator(model, max_len=args.max_len, batch=1, compile=True,
                                 capture=CaptureOptions(kinds=GREEDY_KINDS, progress=False))
    kinds = CaptureOptions(kinds=(*GREEDY_KINDS, "verify_greedy"), progress=False)
    k, n = configs[0]
    # "always": every step a verify step (the draft rule alone: its tokens per step equal the ceiling).
    systems[f"lookup k={k} n={n} always"] = Generator(
        model, max_len=args.max_len, batch=1, compile=True, capture=kinds,
        speculate=PromptLookup(k, n, min_tokens_per_step=0, skip_unmatched=False))
    for k, n in configs:  # the defaults: plain steps where nothing matches (CPU), fallback on low acceptance
        systems[f"lookup k={k} n={n}"] = Generator(
            model, max_len=args.max_len, batch=1, compile=True, speculate=PromptLookup(k, n), capture=kinds)
    setup_s = time.perf_counter() - t0
    print(f"setup (compile) {setup_s:.0f} s", file=sys.stderr)

    results: dict[str, dict] = {}
    for pname, prompt in prompts.items():
        want = systems["plain"].generate(prompt, args.max_new_tokens)
        rows: dict[str, dict] = {}
        for sname in systems:
            rows[sname] = {"decode_tok_s": [], "e2e_tok_s": [], "accepted_per_step": None, "same": None}
        for _ in range(args.repeats):
            for sname, gen in systems.items():  # interleaved: one request of each system per round
                got = gen.generate(prompt, args.max_new_tokens)
                s = gen.stats
                r = rows[sname]
                r["same"] = (got == want) if r["same"] is None else (r["same"] and got == want)
                r["decode_tok_s"].append((s.new_tokens - 1) / s.decode_s)
                r["e2e_tok_s"].append(s.tokens_per_s)
                r["accepted_per_step"] = s.accepted_per_step
                r["verify_steps"], r["decode_steps"] = s.verify_steps, s.decode_steps
        for sname, r in rows.items():
            r["decode_tok_s"] = statistics.median(r["decode_tok_s"])
            r["e2e_tok_s"] = statistics.median(r["e2e_tok_s"])
            if sname != "plain":
                k, n = (int(x.split("=")[1]) for x in sname.split()[1:3])
                r["ceiling"] = simulated_lookup(prompt, want, k, n)
                r["speedup_decode"] = r["decode_tok_s"] / rows["plain"]["decode_tok_s"]
                r["speedup_e2e"] = r["e2e_tok_s"] / rows["plain"]["e2e_tok_s"]
            if not r["same"]:
                raise SystemExit(f"{sname} on {pname}: output differs from plain decode")
        results[pname] = {"prompt_tokens": len(prompt), "new_tokens": len(want), "systems": rows}
        print(table({"prompts": {pname: results[pname]}, "bare_step_ms": {}}), flush=True)  # kept if a later part fails

    costs = {}
    length = len(prompts["edit"]) + 64
    costs["decode_greedy (1 slot)"] = bare_step_ms(systems["plain"], "decode_greedy", length)
    for k, n in configs:
        costs[f"verify_greedy ({k + 1} slots)"] = bare_step_ms(systems[f"lookup k={k} n={n}"], "verify_greedy", length)
    costs["decode_greedy (1 slot), again"] = bare_step_ms(systems["plain"], "decode_greedy", length)
    doc = {
        "model": str(args.model), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "max_new_tokens": args.max_new_tokens,
        "max_len": args.max_len, "repeats": args.repeats, "setup_s": setup_s, "prompts": results,
        "bare_step_ms": costs,
    }
    print(table(doc))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(table(doc) + "\n")
    return 0


def table(doc: dict) -> str:
    lines = ["| prompt | system | decode tok/s | x plain | end-to-end tok/s | x plain | verify / all steps | "
             "tokens per verify step | tokens per step | ceiling (always verify) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for pname, p in doc["prompts"].items():
        for sname, r in p["systems"].items():
            per_step = (p["new_tokens"] - 1) / r["decode_steps"] if r.get("decode_steps") else 1.0
            lines.append(
                f"| {pname} ({p['prompt_tokens']}+{p['new_tokens']}) | {sname} | {r['decode_tok_s']:.1f} | "
                f"{r.get('speedup_decode', 1.0):.2f} | {r['e2e_tok_s']:.1f} | {r.get('speedup_e2e', 1.0):.2f} | "
                f"{r.get('verify_steps', 0)} / {r.get('decode_steps', 0)} | {r['accepted_per_step']:.2f} | "
                f"{per_step:.2f} | {r.get('ceiling', 1.0):.2f} |"
            )
    lines.append("")
    lines.append("| bare step | ms |")
    lines.append("|---|---:|")
    for name, ms in doc["bare_step_ms"].items():
        lines.append(f"| {name} | {ms:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
