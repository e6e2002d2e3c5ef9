"""`static-decode serve` for the server tests: a subprocess on a free port (`Server`), the embedded model with a
chat template (`chat_model`, tests/commands/conftest.py's fixture), an openai client for it, and a raw POST."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[2]
MAX_LEN = 512
QUEUE = 3
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}"


class Server:
    """A `static-decode serve` subprocess; `url` once it printed its address line."""

    def __init__(self, model: Path, *extra: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "static_decode", "serve", "--model", str(model), "--port", "0",
             "--max-len", str(MAX_LEN), "--queue", str(QUEUE), *extra],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.lines: list[str] = []
        line = self.proc.stdout.readline()  # blocks until the server listens (or dies)
        if " on http://" not in line:
            self.proc.kill()
            raise RuntimeError(f"the server did not start: {line!r} {self.proc.stderr.read()}")
        self.url = line.split(" on ", 1)[1].split()[0]
        self.line = line

    def rss_kb(self) -> int:
        for row in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if row.startswith("VmRSS:"):
                return int(row.split()[1])
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _post(server: Server, path: str, body: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
