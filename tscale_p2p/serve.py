"""An OpenAI-compatible completion server over a `GenerationEngine`: ``POST /v1/completions`` and
``POST /v1/chat/completions`` (each with ``"stream": true`` as server-sent events; chat messages become a plain
transcript for our base models, see `tscale_p2p.chat`), ``GET /v1/models``, ``GET /health``, and
``GET /metrics`` in Prometheus' text format (`tscale_p2p.serve_metrics`).

The standard library's threading HTTP server parses requests (one thread each); a single worker thread owns
the engine. Requests queue up in an inbox; before every decode step the worker moves as many waiting
sequences as there are free slots into the batch (one prefill for all of them), so requests that arrive
together share every decode step, and a new request joins a running batch at the next step.

Bad requests get a 4xx JSON error in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``
(bodies are checked by `tscale_p2p.serve_requests`); nothing a client sends can stop the server or fail
another client's request.
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from tscale_p2p.errors import UserError
from tscale_p2p.generate import GenerationEngine, GenerationSequence
from tscale_p2p.serve_metrics import ServerMetrics
from tscale_p2p.serve_requests import (
    CompletionRequest,
    RequestError,
    parse_chat_request,
    parse_completion_request,
    parse_json,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
# Connections the kernel queues while the serving thread is busy starting handler threads: socketserver's
# default of 5 resets the rest of a burst of clients (Linux caps it at net.core.somaxconn).
LISTEN_BACKLOG = 1024


class CompletionService:
    """The worker thread that owns the engine: batches what is submitted and reports each sequence's text.

    Each submitted batch of sequences has one outbox (a queue) that receives ``(index, text, finish_reason)``
    events, and ``(None, message, "error")`` if the engine fails."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine
        self.decode_steps = 0
        self.metrics = ServerMetrics(self.status)
        self._inbox: queue.Queue[tuple[list[GenerationSequence], queue.Queue]] = queue.Queue()
        self._waiting: list[GenerationSequence] = []
        self._outboxes: dict[GenerationSequence, tuple[int, queue.Queue]] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="generation", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def submit(self, seqs: list[GenerationSequence]) -> queue.Queue:
        outbox: queue.Queue = queue.Queue()
        self._inbox.put((seqs, outbox))
        return outbox

    def status(self) -> dict:
        return {"slots": len(self.engine.slots), "active": len(self.engine.active), "waiting": len(self._waiting)}

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._collect(block=not (self._waiting or self.engine.active))
            self._forget_cancelled()
            admitted = self._waiting[: self.engine.free_slots]
            self._waiting = self._waiting[len(admitted) :]
            try:
                self.metrics.count_prefill(sum(len(seq.prompt) for seq in admitted))
                self._post(self.engine.admit(admitted))
                if self.engine.active:
                    self._post(self.engine.step())
                    self.decode_steps += 1
            except Exception as error:  # a failing engine fails its requests, never the server
                log.exception("generation failed")
                self._fail(admitted + self.engine.active, f"generation failed: {error}")

    def _forget_cancelled(self) -> None:
        """Drop sequences whose client went away: from the queue, and their outboxes (the engine frees
        their slots at its next step)."""
        self._waiting = [seq for seq in self._waiting if not seq.cancelled]
        for seq in [seq for seq in self._outboxes if seq.cancelled]:
            del self._outboxes[seq]

    def _collect(self, block: bool) -> None:
        try:
            seqs, outbox = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
            while True:
                for index, seq in enumerate(seqs):
                    self._outboxes[seq] = (index, outbox)
                self._waiting.extend(seqs)
                seqs, outbox = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _post(self, deltas: dict[GenerationSequence, str]) -> None:
        self.metrics.count_generated(len(deltas))  # admit and step each give every sequence one token
        for seq, text in deltas.items():
            if seq not in self._outboxes:  # its client went away meanwhile
                continue
            index, outbox = self._outboxes[seq]
            outbox.put((index, text, seq.finish_reason))
            if seq.done:
                del self._outboxes[seq]

    def _fail(self, seqs: list[GenerationSequence], message: str) -> None:
        outboxes = {id(box): box for box in (self._outboxes.pop(seq, (0, None))[1] for seq in seqs) if box}
        self.engine.cancel(seqs)
        for outbox in outboxes.values():
            outbox.put((None, message, "error"))


class CompletionServer(ThreadingHTTPServer):
    """The HTTP front: `serve_forever()` in the foreground, or `start()` / `close()` around it."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, engine: GenerationEngine, model_id: str, host: str = "127.0.0.1", port: int = 8000):
        self.model_id = model_id
        self.created = int(time.time())
        self.service = CompletionService(engine)
        try:
            super().__init__((host, port), _CompletionHandler)
        except OSError as error:
            raise UserError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
        self.service.start()
        self._thread: threading.Thread | None = None

    def handle_error(self, request, client_address) -> None:
        """A client that drops its kept-alive connection (the openai package does when its program exits) is
        routine: a debug line, not socketserver's traceback on stderr."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionResetError, BrokenPipeError)):
            log.debug("client %s closed its connection: %s", client_address[0], error)
        else:
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        """Serve in a background thread."""
        # `close()` waits for the serving loop's next poll: poll often, so closing takes milliseconds, not 0.5 s.
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.02}, name="http",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving (from another thread than `serve_forever`'s), stop the worker, free the port."""
        self.shutdown()
        if self._thread is not None:
            self._thread.join()
        self.service.stop()
        self.server_close()


class _CompletionHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: CompletionServer

    def log_message(self, format: str, *args) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def send_response(self, code: int, message: str | None = None) -> None:
        self.server.service.metrics.count_request(urlsplit(self.path).path, code)  # every answer passes here
        super().send_response(code, message)

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        model = {"id": self.server.model_id, "object": "model", "created": self.server.created,
                 "owned_by": "tscale-p2p"}
        if path == "/health":
            status = {"status": "ok", "model": self.server.model_id, **self.server.service.status()}
            self._send_json(HTTPStatus.OK, status)
        elif path == "/v1/models":
            self._send_json(HTTPStatus.OK, {"object": "list", "data": [model]})
        elif path == f"/v1/models/{self.server.model_id}":
            self._send_json(HTTPStatus.OK, model)
        elif path == "/metrics":
            body, content_type = self.server.service.metrics.exposition(self.headers.get("Accept"))
            self._send_body(HTTPStatus.OK, body, content_type)
        else:
            self._send_error(RequestError(HTTPStatus.NOT_FOUND, f"no such endpoint: GET {self.path}"))

    def do_POST(self) -> None:
        engine = self.server.service.engine
        try:
            path = urlsplit(self.path).path
            if path == "/v1/completions":
                request = parse_completion_request(self._read_json(), self.server.model_id)
            elif path == "/v1/chat/completions":
                request = parse_chat_request(self._read_json(), self.server.model_id, engine.cfg.context)
            else:
                self._read_body()  # keep the connection usable
                raise RequestError(HTTPStatus.NOT_FOUND, f"no such endpoint: POST {self.path}")
            seqs = request.sequences(engine.tokenizer)
            for seq in seqs:
                engine.check(seq)
        except RequestError as error:
            self._send_error(error)
            return
        except UserError as error:
            param = "messages" if path == "/v1/chat/completions" else "prompt"  # what the engine found too long
            self._send_error(RequestError(HTTPStatus.BAD_REQUEST, str(error), param))
            return
        except Exception as error:  # a bug met by an odd request: answer it, never drop the connection
            log.exception("cannot handle POST %s", self.path)
            self._send_error(RequestError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {error}"))
            return
        outbox = self.server.service.submit(seqs)
        kind = "chat.completion" if request.chat else "text_completion"
        envelope = {"id": f"{'chatcmpl' if request.chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
                    "created": int(time.time()), "model": self.server.model_id}
        try:
            if request.stream:
                self._stream(request, seqs, outbox, envelope)
            else:
                self._complete(request, seqs, outbox, envelope)
        except (BrokenPipeError, ConnectionResetError):
            log.info("client %s went away; cancelling its %d completion(s)", self.address_string(), len(seqs))
        finally:
            for seq in seqs:
                seq.cancelled = seq.cancelled or not seq.done

    def _complete(
        self, request: CompletionRequest, seqs: list[GenerationSequence], outbox: queue.Queue, envelope: dict
    ) -> None:
        texts, reasons = [""] * len(seqs), [None] * len(seqs)
        while not all(reasons):
            index, text, reason = outbox.get()
            if reason == "error":
                self._send_error(RequestError(HTTPStatus.INTERNAL_SERVER_ERROR, text, code="generation_failed"))
                return
            texts[index] += text
            reasons[index] = reason
        if request.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": reason} for i, (text, reason) in enumerate(zip(texts, reasons))]
        else:
            choices = [{"index": i, "text": self._echo(request, i) + text, "logprobs": None, "finish_reason": reason}
                       for i, (text, reason) in enumerate(zip(texts, reasons))]
        self._send_json(HTTPStatus.OK, {**envelope, "choices": choices, "usage": self._usage(request, seqs)})

    @staticmethod
    def _usage(request: CompletionRequest, seqs: list[GenerationSequence]) -> dict:
        prompt_tokens = sum(len(seq.prompt) for seq in seqs[:: request.n])
        completion_tokens = sum(len(seq.tokens) for seq in seqs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _stream(
        self, request: CompletionRequest, seqs: list[GenerationSequence], outbox: queue.Queue, envelope: dict
    ) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if request.chat:  # chat streams open each choice with the speaker's role
            envelope = {**envelope, "object": "chat.completion.chunk"}
            for i in range(len(seqs)):
                opening = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}
                self._send_event({**envelope, "choices": [opening]})
        elif request.echo:
            for i in range(len(seqs)):
                self._send_event({**envelope, "choices": [self._chunk(i, self._echo(request, i), None)]})
        remaining = len(seqs)
        while remaining:
            index, text, reason = outbox.get()
            if reason == "error":
                self._send_event({"error": {"message": text, "type": "server_error", "param": None,
                                            "code": "generation_failed"}})
                break
            if text or reason:
                chunk = self._chat_chunk(index, text, reason) if request.chat else self._chunk(index, text, reason)
                self._send_event({**envelope, "choices": [chunk]})
            remaining -= reason is not None
        else:  # every choice finished
            if request.include_usage:  # as OpenAI sends it: no choices, the whole request's counts
                self._send_event({**envelope, "choices": [], "usage": self._usage(request, seqs)})
        self._send_chunk(b"data: [DONE]\n\n")
        self._send_chunk(b"")

    def _echo(self, request: CompletionRequest, index: int) -> str:
        return request.prompts[index // request.n] if request.echo else ""

    @staticmethod
    def _chunk(index: int, text: str, reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}

    @staticmethod
    def _chat_chunk(index: int, text: str, reason: str | None) -> dict:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": reason}

    def _send_event(self, payload: dict) -> None:
        self._send_chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _send_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise RequestError(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required")
        if not (length.isascii() and length.isdigit()):
            self.close_connection = True
            raise RequestError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length[:40]!r}")
        if len(length) > 18 or int(length) > MAX_BODY_BYTES:  # 18 digits: int() stays cheap
            self.close_connection = True
            raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"request body over {MAX_BODY_BYTES} bytes")
        return self.rfile.read(int(length))

    def _read_json(self) -> object:
        return parse_json(self._read_body())

    def _send_error(self, error: RequestError) -> None:
        kind = "invalid_request_error" if error.status < 500 else "server_error"
        self._send_json(error.status, {"error": {"message": error.message, "type": kind, "param": error.param,
                                                 "code": error.code}})

    def _send_json(self, status: HTTPStatus, payload: dict) -> None:
        self._send_body(status, json.dumps(payload).encode(), "application/json")

    def _send_body(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
