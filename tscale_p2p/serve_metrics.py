"""What ``GET /metrics`` of `serve` reports, in Prometheus' text format (as vLLM and llama.cpp's servers do).

prometheus_client writes the format (HELP/TYPE lines, ``_total`` counters, label escaping, and OpenMetrics
when a scraper asks for it in its Accept header); each server has a registry of its own, so several servers
in one process (tests) never mix their counts.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import choose_encoder

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
RATE_WINDOW_S = 10.0


class ServerMetrics:
    """Counters of one server: the HTTP front counts requests, the generation worker counts tokens; gauges
    (queue length, running sequences) are read from `status` when scraped."""

    def __init__(self, status: Callable[[], dict], window_s: float = RATE_WINDOW_S) -> None:
        """`status` is `CompletionService.status` (slots, active, waiting)."""
        self.registry = CollectorRegistry()
        self.requests = Counter("tscale_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "code"], registry=self.registry)
        self.prompt_tokens = Counter("tscale_prompt_tokens", "Prompt tokens prefilled", registry=self.registry)
        self.generation_tokens = Counter("tscale_generation_tokens", "Tokens generated", registry=self.registry)
        rate = Gauge("tscale_generation_tokens_per_second",
                     f"Tokens generated per second over the last {window_s:g} s", registry=self.registry)
        rate.set_function(self.tokens_per_second)
        for key, name, text in (
            ("active", "tscale_sequences_running", "Sequences in the decode batch"),
            ("waiting", "tscale_sequences_waiting", "Sequences queued for a free slot (the queue length)"),
            ("slots", "tscale_batch_slots", "Sequences the engine generates at once (--max-batch)"),
        ):
            Gauge(name, text, registry=self.registry).set_function(lambda key=key: status()[key])
        self.window_s = window_s
        self._started = time.monotonic()
        self._recent: deque[tuple[float, int]] = deque()  # (monotonic time, tokens generated then)
        self._lock = threading.Lock()

    def count_request(self, path: str, code: int) -> None:
        self.requests.labels(path if path in ENDPOINTS else "other", str(code)).inc()

    def count_prefill(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def count_generated(self, tokens: int) -> None:
        if tokens:
            self.generation_tokens.inc(tokens)
            with self._lock:
                self._recent.append((time.monotonic(), tokens))

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self.window_s:
                self._recent.popleft()
            tokens = sum(n for _, n in self._recent)
        return tokens / max(1e-3, min(self.window_s, now - self._started))

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """(body, content type) for a scrape with this Accept header."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type
