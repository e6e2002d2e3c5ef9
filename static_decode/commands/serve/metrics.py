"""`serve --metrics`: Prometheus metrics of the server at GET /metrics (prometheus-client, the `serve` extra).

static_decode_requests_total{endpoint, status}: the answered requests by route (unknown paths as "other") and HTTP
status (a streamed response counts its 200 at the start); static_decode_queue_depth: the requests waiting behind
the running one; static_decode_prefill_ms and static_decode_ms_per_token: histograms of each completed request's
prefill (to its first token on the host) and decode time per token, the `usage` numbers of its response. Each
server has a registry of its own (not the process-wide default), so that nothing but these is exported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PREFILL_MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000)
MS_PER_TOKEN_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


class Metrics:
    """The server's metrics; `asgi(app)` wraps the app to count its answers, `body()` is the exposition text."""

    def __init__(self, waiting: Callable[[], int], endpoints: tuple[str, ...]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.endpoints = frozenset(endpoints)
        self.requests = Counter("static_decode_requests", "Answered HTTP requests by endpoint and status",
                                ("endpoint", "status"), registry=self.registry)
        self.queue = Gauge("static_decode_queue_depth", "Requests waiting behind the running one",
                           registry=self.registry)
        self.queue.set_function(waiting)
        self.prefill = Histogram("static_decode_prefill_ms", "Prefill time of a completed request, to its first "
                                 "token on the host (ms)", buckets=PREFILL_MS_BUCKETS, registry=self.registry)
        self.per_token = Histogram("static_decode_ms_per_token", "Decode time per token of a completed request (ms)",
                                   buckets=MS_PER_TOKEN_BUCKETS, registry=self.registry)

    def observe(self, prefill_ms: float, ms_per_token: float, new_tokens: int) -> None:
        """One completed request's timings (its decode time only when it decoded past its first token)."""
        self.prefill.observe(prefill_ms)
        if new_tokens > 1:
            self.per_token.observe(ms_per_token)

    def body(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def asgi(self, app: Any) -> Any:
        """`app` with every HTTP answer counted (by its route and the status it starts with)."""

        async def counted(scope: dict, receive: Callable, send: Callable) -> None:
            if scope["type"] != "http":
                return await app(scope, receive, send)
            path = scope.get("path", "")
            endpoint = path if path in self.endpoints else "other"

            async def sending(message: dict) -> None:
                if message["type"] == "http.response.start":
                    self.requests.labels(endpoint, str(message["status"])).inc()
                await send(message)

            await app(scope, receive, sending)

        return counted
