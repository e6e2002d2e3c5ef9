"""llama.cpp's perplexity of GGUFs on the text and tokens `quant_perplexity.py` scores (llama-cpp-python).

    python profiles/quant_llamacpp_ppl.py --model DIR --gguf NAME=FILE,... [--tokens 1024] [--chunk 256]

The token ids come from the checkpoint's own tokenizer (the same ids static-decode scores), fed to llama.cpp in
`--chunk`-token batches over one context (its KV cache), every position's logits kept; perplexity = exp(mean NLL)
over the tokens - 1 predictions, computed here in float64 from llama.cpp's logits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from static_decode.checkpoints.loading import load_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--gguf", required=True, help="NAME=FILE,...")
    p.add_argument("--text", type=Path, default=Path(argparse.__file__))
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=256)
    args = p.parse_args()
    import llama_cpp

    ids = load_tokenizer(args.model).encode(args.text.read_text(), add_special_tokens=False).ids[: args.tokens]
    for item in args.gguf.split(","):
        name, _, file = item.partition("=")
        llm = llama_cpp.Llama(model_path=file, n_ctx=len(ids), n_batch=args.chunk, n_ubatch=args.chunk,
                              n_threads=1, n_threads_batch=1, logits_all=True, verbose=False)
        for lo in range(0, len(ids), args.chunk):
            llm.eval(ids[lo:lo + args.chunk])
        logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)  # [N, V]
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        nll = float(np.mean(logz[:-1] - logits[np.arange(len(ids) - 1), ids[1:]]))
        print(json.dumps({"gguf": name, "perplexity": round(float(np.exp(nll)), 4), "tokens": len(ids)}), flush=True)
        llm.close()


if __name__ == "__main__":
    main()
