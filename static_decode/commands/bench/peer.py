"""A peer system's worker process, so that a peer that crashes or hangs costs its own row and not the bench.

PeerProcess starts `python -m MODULE` (static_decode.commands.bench.llama_cpp_worker), sends it one JSON request a line
on stdin and reads one JSON reply a line from its stdout, each within a bounded wait. A worker that dies
(a signal, an exit), stops answering, or answers {"ok": false} raises PeerFailed, whose message is what the
bench reports in that system's row ("crashed, SIGSEGV"); the worker's stderr is kept in a temporary file and its
last lines go with the failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

STDERR_TAIL = 20  # lines of the worker's stderr kept with a failure

# How to build llama-cpp-python without AMX: its native build's AMX path segfaults on Q8_0/Q4_0 on some Xeons.
# pip caches the wheel by version, not by CMAKE_ARGS, hence --no-cache-dir.
NO_AMX_BUILD = (
    "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
    "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF' "
    "pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36"
)


def has_amx(system_info: str) -> bool:
    """Whether llama.cpp's system line ("... AMX_INT8 = 1 | ...") says its CPU backend uses AMX."""
    return any(f"{flag} = 1" in system_info for flag in ("AMX", "AMX_INT8", "AMX_BF16", "AMX_TILE"))


def amx_hint(system_info: str) -> str:
    """The rebuild hint for a crash of an AMX build ("" for any other build)."""
    if not has_amx(system_info):
        return ""
    return ("this llama.cpp build uses AMX (its system info has AMX_INT8 = 1), whose Q8_0/Q4_0 path crashes on some "
            f"Xeons; rebuild it without AMX: {NO_AMX_BUILD}")


class PeerFailed(RuntimeError):
    """A peer's worker crashed, hung, exited or raised; str(e) is the row's text, `detail` its stderr's tail,
    `system_info` the peer's build line where it told it (for amx_hint)."""

    def __init__(self, what: str, detail: str = "", system_info: str = "") -> None:
        super().__init__(what)
        self.what, self.detail, self.system_info = what, detail, system_info


class PeerProcess:
    """One worker process speaking JSON lines; every call waits at most `timeout_s` for its reply."""

    def __init__(self, module: str, timeout_s: float, env: dict[str, str] | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"peer timeout must be > 0 s, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the worker, closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            env=env, start_new_session=True,  # Ctrl-C reaches the bench, which ends the worker itself
        )
        self._buf = b""
        self.failure: PeerFailed | None = None

    def call(self, msg: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Send one request and return its reply; PeerFailed if the worker dies, exceeds the wait or refuses."""
        if self.failure is not None:
            raise self.failure
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
            reply = self._read_line(self.timeout_s if timeout_s is None else timeout_s)
        except PeerFailed as e:
            self.failure = e
            self.kill()
            raise
        except (BrokenPipeError, OSError):
            self.failure = self._died()
            self.close()
            raise self.failure from None
        out = json.loads(reply)
        if not out.get("ok"):
            self.failure = PeerFailed(f"failed: {out.get('error', 'no reason given')}", self._tail())
            self.close()
            raise self.failure
        return out

    def _read_line(self, timeout_s: float) -> bytes:
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerFailed(f"hung: no answer within {timeout_s:g} s (killed)", self._tail())
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise self._died()
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _died(self) -> PeerFailed:
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return PeerFailed("closed its pipe without exiting (killed)", self._tail())
        if rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            return PeerFailed(f"crashed, {name}", self._tail())
        return PeerFailed(f"exited with status {rc}", self._tail())

    def _tail(self) -> str:
        try:
            self._stderr.seek(0)
            lines = self._stderr.read().decode(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            return ""
        return "\n".join(lines[-STDERR_TAIL:])

    def kill(self) -> None:
        """End the worker now (a hung one is not asked)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.close()

    def close(self) -> None:
        """End the worker (asked first, killed if it does not go within a few seconds)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()
        if self.proc.returncode is not None:  # what it printed is read (by a failure) before the worker goes
            self._stderr.close()

    def __del__(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
