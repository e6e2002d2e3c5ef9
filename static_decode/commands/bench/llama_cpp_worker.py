"""The llama.cpp bench system's worker process: llama-cpp-python on one GGUF, driven over a pipe.

`static-decode bench` runs each llama.cpp system in a process of its own (static_decode.commands.bench.peer),
so a peer that crashes (llama.cpp's AMX path segfaults on Q8_0/Q4_0 on some Xeons) or hangs costs its own row,
not the whole bench. Run as `python -m static_decode.commands.bench.llama_cpp_worker`; it imports llama_cpp and
numpy only, never torch.

Protocol: one JSON object a line, ops info, load, start, finish, exit; replies go to the original stdout, with
stdout pointed at stderr so nothing llama.cpp prints can corrupt one. Every message: docs/internals.md#llamacpp-worker.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from typing import Any


class Peer:
    """llama-cpp-python's Llama on one GGUF, greedy by the logits of the last evaluated token."""

    def __init__(self, gguf: str, n_ctx: int, threads: int) -> None:
        import llama_cpp
        import numpy as np

        self._llama_cpp, self._np = llama_cpp, np
        # n_gpu_layers=0 keeps every layer on the CPU whatever backend the wheel was built with; the prompt's batch
        # threads match the decode threads.
        self.llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_gpu_layers=0, logits_all=False, verbose=False)
        self.vocab = self.llm.n_vocab()
        self._first, self._left = 0, 0

    def facts(self) -> dict[str, Any]:
        return {"n_vocab": self.vocab, "n_ctx": self.llm.n_ctx(), "n_batch": self.llm.n_batch,
                "file_type": self.llm.metadata.get("general.file_type", "?")}

    def _eval_argmax(self, tokens: list[int]) -> int:
        self.llm.eval(tokens)
        row = self._llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)  # the batch's last (only) output row
        return int(self._np.ctypeslib.as_array(row, shape=(self.vocab,)).argmax())

    def start(self, prompt: list[int], new_tokens: int) -> int:
        # reset() sets the position to 0; eval then drops every cached K/V from there on (memory_seq_rm) before
        # the prompt goes in, so a request never sees the previous one's cache.
        self.llm.reset()
        self._left = new_tokens - 1
        self._first = self._eval_argmax(list(prompt))
        return self._first

    def finish(self) -> list[int]:
        out = [self._first]
        for _ in range(self._left):
            out.append(self._eval_argmax([out[-1]]))
        return out


def handle(peer: Peer | None, msg: dict[str, Any]) -> tuple[Peer | None, dict[str, Any]]:
    """One request's reply (and the peer, made by "load")."""
    op = msg.get("op")
    if op == "info":
        import llama_cpp

        info = llama_cpp.llama_print_system_info()
        return peer, {"ok": True, "version": getattr(llama_cpp, "__version__", "?"),
                      "system_info": info.decode(errors="replace") if isinstance(info, bytes) else str(info)}
    if op == "load":
        peer = Peer(str(msg["gguf"]), int(msg["n_ctx"]), int(msg["threads"]))
        return peer, {"ok": True, **peer.facts()}
    if peer is None:
        raise RuntimeError(f"{op!r} before 'load'")
    if op == "start":
        return peer, {"ok": True, "first": peer.start([int(t) for t in msg["prompt"]], int(msg["new_tokens"]))}
    if op == "finish":
        return peer, {"ok": True, "tokens": peer.finish()}
    raise ValueError(f"unknown op {op!r}")


def main() -> int:
    reply = os.fdopen(os.dup(1), "w", buffering=1)  # the replies' channel: what stdout was
    os.dup2(2, 1)  # stdout from here on (C and Python alike) goes to stderr
    sys.stdout = sys.stderr
    faulthandler.enable()  # a crash leaves its Python stack in stderr, which the bench keeps for its note
    peer = None
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("op") == "exit":
            break
        try:
            peer, out = handle(peer, msg)
        except Exception as e:  # noqa: BLE001 - the parent reports any failure as this system's row
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        reply.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
