"""The OpenAI-compatible server, spoken to by a real HTTP client over 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from prometheus_client.parser import text_string_to_metric_families

from tscale_p2p import cli
from tscale_p2p.chat import TURN_STARTS, render_transcript
from tscale_p2p.checkpoint import save_checkpoint
from tscale_p2p.generate import GenerationEngine
from tscale_p2p.model import ModelConfig, Transformer
from tscale_p2p.serve import CompletionServer

MODEL_ID = "tiny-run"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig.from_dims("e64h4d4w128", short_window=8, first_window=4)
    return Transformer(cfg).eval()


@pytest.fixture
def server(model):
    server = CompletionServer(GenerationEngine(model, slots=4), MODEL_ID, "127.0.0.1", 0)
    server.start()
    yield server
    server.close()


def request(server, method: str, path: str, body=None, raw: bytes | None = None):
    host, port = server.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=30)
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    connection.request(method, path, body=data, headers=headers)
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    return response, payload


def post(server, body):
    response, payload = request(server, "POST", "/v1/completions", body)
    return response.status, json.loads(payload)


def events(payload: bytes) -> list:
    lines = [line for line in payload.decode().split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def test_health_and_models(server):
    response, payload = request(server, "GET", "/health")
    assert response.status == 200 and json.loads(payload)["status"] == "ok"
    response, payload = request(server, "GET", "/v1/models")
    models = json.loads(payload)
    assert response.status == 200 and [m["id"] for m in models["data"]] == [MODEL_ID]


def test_completion_is_greedy_and_reproducible_and_counts_tokens(server):
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 20, "temperature": 0}
    status, first = post(server, body)
    assert status == 200
    [choice] = first["choices"]
    assert first["object"] == "text_completion" and first["model"] == MODEL_ID
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert first["usage"] == {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25}
    status, second = post(server, body)
    assert second["choices"][0]["text"] == choice["text"]


def test_streaming_sends_the_same_text_as_server_sent_events(server):
    body = {"prompt": "Hello", "max_tokens": 20, "temperature": 0}
    _, plain = post(server, body)
    response, payload = request(server, "POST", "/v1/completions", {**body, "stream": True})
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    chunks = events(payload)
    assert len(chunks) > 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stop_strings_and_several_choices(server):
    status, result = post(server, {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 30, "temperature": 1.0, "seed": 3})
    assert status == 200 and [c["index"] for c in result["choices"]] == [0, 1, 2, 3]
    text = result["choices"][0]["text"]
    assert text != result["choices"][1]["text"]  # n choices of one seeded request differ
    stop = text[5:7]
    status, cut = post(server, {"prompt": "ab", "max_tokens": 30, "temperature": 1.0, "seed": 3, "stop": [stop]})
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_echo_puts_the_prompt_in_front(server):
    body = {"prompt": "Echo me", "max_tokens": 5, "temperature": 0}
    _, plain = post(server, body)
    _, echoed = post(server, {**body, "echo": True})
    assert echoed["choices"][0]["text"] == "Echo me" + plain["choices"][0]["text"]
    _, payload = request(server, "POST", "/v1/completions", {**body, "echo": True, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in events(payload)) == echoed["choices"][0]["text"]


def test_requests_arriving_together_share_decode_steps(server):
    bodies = [{"prompt": f"request {i}", "max_tokens": 60, "temperature": 0} for i in range(3)]
    results = [None] * 3
    steps_before = server.service.decode_steps

    def send(i):
        results[i] = post(server, bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(status == 200 for status, _ in results)
    # One after the other would take 3 x 59 decode steps; batched, little more than 59.
    assert server.service.decode_steps - steps_before < 2 * 59
    _, alone = post(server, bodies[1])
    assert alone["choices"][0]["text"] == results[1][1]["choices"][0]["text"]


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": "hi", "temperature": -1}, 400, None),
        ({"prompt": "hi", "top_p": 0}, 400, None),
        ({"prompt": "hi", "top_k": -2}, 400, None),
        ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
        ({"prompt": "hi", "stop": 5}, 400, "stop"),
        ({"prompt": 42}, 400, "prompt"),
        ({"max_tokens": 5}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "x" * 129}, 400, "prompt"),
        ({"prompt": "hi", "logprobs": 2}, 400, "logprobs"),
        ({"prompt": "hi", "n": 100}, 400, "n"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
        ([1, 2], 400, None),
    ],
)
def test_bad_requests_get_a_json_error(server, body, status, param):
    got, payload = post(server, body)
    assert got == status
    assert payload["error"]["param"] == param and payload["error"]["message"]


def test_malformed_http_gets_an_error_and_the_server_keeps_serving(server):
    response, payload = request(server, "POST", "/v1/completions", raw=b"{not json")
    assert response.status == 400 and "JSON" in json.loads(payload)["error"]["message"]
    response, _ = request(server, "POST", "/v1/embeddings", {"input": "hi"})
    assert response.status == 404
    response, _ = request(server, "GET", "/nothing")
    assert response.status == 404
    # Refused from the Content-Length header alone, before any body is read (sending a real 2 MiB body races
    # with the server closing the connection: the client may see a broken pipe instead of the answer).
    connection = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Content-Length", str(1 << 21))
    connection.endheaders()
    assert connection.getresponse().status == 413
    connection.close()
    assert post(server, {"prompt": "still", "max_tokens": 2})[0] == 200


def test_a_client_that_leaves_mid_stream_is_cancelled(server):
    steps_before = server.service.decode_steps
    host, port = server.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=30)
    body = json.dumps({"prompt": "go", "max_tokens": 126, "stream": True, "temperature": 0})
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.read1(10)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    deadline = time.monotonic() + 20
    while server.service.status()["active"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.service.status()["active"] == 0
    assert server.service.decode_steps - steps_before < 100  # finishing would have taken 125 steps
    status, result = post(server, {"prompt": "next", "max_tokens": 3})
    assert status == 200 and result["choices"][0]["finish_reason"] == "length"


def test_serve_cli_serves_a_checkpoint_until_interrupted(model, tmp_path):
    save_checkpoint(tmp_path / "myrun", step=1, model_state=model.state_dict(), model_config=model.cfg.to_dict())
    command = [sys.executable, "-m", "tscale_p2p.cli", "serve", "--checkpoint", str(tmp_path / "myrun"),
               "--port", "0", "--device", "cpu", "--max-batch", "2"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not (match := re.search(r"serving 'myrun' at http://127\.0\.0\.1:(\d+)/v1", lines[-1] if lines else "")):
            lines.append(process.stderr.readline())
            assert lines[-1], f"serve exited: {lines}"
        connection = http.client.HTTPConnection("127.0.0.1", int(match.group(1)), timeout=30)
        connection.request("POST", "/v1/completions", body=json.dumps({"model": "myrun", "prompt": "hi"}))
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] == 16
        connection.close()
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()


def test_serve_cli_refuses_a_busy_port(model, tmp_path, server, capsys):
    save_checkpoint(tmp_path / "run", step=1, model_state=model.state_dict(), model_config=model.cfg.to_dict())
    port = server.server_address[1]
    argv = ["serve", "--checkpoint", str(tmp_path / "run"), "--port", str(port), "--device", "cpu"]
    assert cli.main(argv) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_an_engine_failure_fails_that_request_only(server, monkeypatch):
    engine = server.service.engine
    real_prefill = engine._prefill
    calls = []

    def failing_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory (injected)")
        return real_prefill(*args)

    monkeypatch.setattr(engine, "_prefill", failing_once)
    status, payload = post(server, {"prompt": "boom", "max_tokens": 4})
    assert status == 500 and "out of memory (injected)" in payload["error"]["message"]
    assert server.service.status()["active"] == 0
    status, payload = post(server, {"prompt": "fine", "max_tokens": 4})
    assert status == 200 and payload["usage"]["completion_tokens"] == 4


CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Hello there"}]


def test_chat_messages_become_a_transcript_and_the_answer_comes_in_the_chat_shape(server):
    transcript = render_transcript(CHAT)
    assert transcript == "System: You answer briefly.\nUser: Hello there\nAssistant:"
    response, payload = request(server, "POST", "/v1/chat/completions",
                                {"model": MODEL_ID, "messages": CHAT, "max_tokens": 20, "temperature": 0})
    chat = json.loads(payload)
    assert response.status == 200 and chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    [choice] = chat["choices"]
    assert choice["message"]["role"] == "assistant" and choice["index"] == 0
    # The same model continuing the same transcript, stopping where it would start a new turn.
    _, plain = post(server, {"prompt": transcript, "max_tokens": 20, "temperature": 0, "stop": list(TURN_STARTS)})
    assert choice["message"]["content"] == plain["choices"][0]["text"]
    assert choice["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert chat["usage"]["prompt_tokens"] == len(transcript.encode())


def test_chat_streams_role_then_content_deltas_then_usage_when_asked(server):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}], "max_tokens": 20,
            "temperature": 0, "tool_choice": "auto", "user": "someone"}  # fields that change nothing pass
    _, payload = request(server, "POST", "/v1/chat/completions", body)
    whole = json.loads(payload)
    response, payload = request(server, "POST", "/v1/chat/completions",
                                {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    chunks = events(payload)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *deltas, usage = chunks[1:]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in deltas)
    assert content == whole["choices"][0]["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in deltas][-1] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in deltas[:-1])
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({}, 400, "messages"),
        ({"messages": []}, 400, "messages"),
        ({"messages": "hi"}, 400, "messages"),
        ({"messages": [{"role": "tool", "content": "42"}]}, 400, "messages"),
        ({"messages": [{"role": "user"}]}, 400, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
         "messages"),
        ({"messages": [{"role": "user", "content": "x" * 200}]}, 400, "messages"),  # longer than the context
        ({"messages": CHAT, "temperature": -1}, 400, None),
        ({"messages": CHAT, "max_completion_tokens": "many"}, 400, "max_completion_tokens"),
        ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ({"messages": CHAT, "logprobs": True}, 400, "logprobs"),
        ({"messages": CHAT, "n": 100}, 400, "n"),
        ({"messages": CHAT, "stream_options": "yes"}, 400, "stream_options"),
        ({"messages": CHAT, "model": "gpt-4o"}, 404, "model"),
    ],
)
def test_bad_chat_requests_get_a_json_error(server, body, status, param):
    response, payload = request(server, "POST", "/v1/chat/completions", body)
    assert response.status == status
    error = json.loads(payload)["error"]
    assert error["param"] == param and error["message"]


def scrape(server, accept: str | None = None) -> tuple[str, dict]:
    """(content type, {(metric sample name, labels as a sorted tuple): value}) of GET /metrics."""
    host, port = server.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=30)
    connection.request("GET", "/metrics", headers={"Accept": accept} if accept else {})
    response = connection.getresponse()
    text = response.read().decode()
    connection.close()
    assert response.status == 200
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    return response.getheader("Content-Type"), samples


def test_metrics_count_requests_and_tokens_in_prometheus_text_format(server):
    _, plain = post(server, {"prompt": "count me", "max_tokens": 7})
    request(server, "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5})
    post(server, {"prompt": "hi", "temperature": -1})
    request(server, "GET", "/nothing")
    content_type, samples = scrape(server)
    assert content_type.startswith("text/plain; version=0.0.4")
    assert samples[("tscale_requests_total", (("code", "200"), ("endpoint", "/v1/completions")))] == 1
    assert samples[("tscale_requests_total", (("code", "200"), ("endpoint", "/v1/chat/completions")))] == 1
    assert samples[("tscale_requests_total", (("code", "400"), ("endpoint", "/v1/completions")))] == 1
    assert samples[("tscale_requests_total", (("code", "404"), ("endpoint", "other")))] == 1
    assert samples[("tscale_generation_tokens_total", ())] == 7 + 5
    assert samples[("tscale_prompt_tokens_total", ())] == len("count me") + len(render_transcript(CHAT))
    assert samples[("tscale_generation_tokens_per_second", ())] > 0
    assert samples[("tscale_batch_slots", ())] == 4 and samples[("tscale_sequences_running", ())] == 0
    # A scraper that asks for OpenMetrics gets it.
    content_type, samples = scrape(server, "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert samples[("tscale_generation_tokens_total", ())] == 12


def test_metrics_show_the_queue_while_the_batch_is_full(server, monkeypatch):
    engine = server.service.engine
    real_step, release = engine.step, threading.Event()

    def held_step():
        assert release.wait(30)
        return real_step()

    monkeypatch.setattr(engine, "step", held_step)  # the first 4 sequences are prefilled, then the worker waits
    result = {}
    sender = threading.Thread(target=lambda: result.update(answer=post(server, {"prompt": "q", "n": 6,
                                                                                 "max_tokens": 3})))
    sender.start()
    try:
        deadline = time.monotonic() + 20
        while server.service.status()["active"] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        _, samples = scrape(server)
        assert samples[("tscale_sequences_running", ())] == 4
        assert samples[("tscale_sequences_waiting", ())] == 2
    finally:
        release.set()
        sender.join(timeout=30)
    status, answer = result["answer"]
    assert status == 200 and len(answer["choices"]) == 6
    _, samples = scrape(server)
    assert samples[("tscale_sequences_waiting", ())] == 0 and samples[("tscale_generation_tokens_total", ())] == 18


def test_a_client_resetting_its_kept_alive_connection_leaves_no_traceback(server, capfd):
    host, port = server.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=30)
    connection.request("GET", "/health")
    assert connection.getresponse().read()
    # The server now waits for the next request on this connection; a reset (not a FIN) ends it.
    connection.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()
    assert request(server, "GET", "/health")[0].status == 200
    time.sleep(0.2)  # the handler thread of the reset connection has long run by now
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"prompt": "hi", "top_k": ' + str(10**30).encode() + b"}", None),
        (b'{"prompt": "hi", "seed": ' + str(10**30).encode() + b"}", None),
        (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", None),  # beyond any int parser's digit limit
        (b'{"prompt": "\\ud800"}', None),  # a lone surrogate: no UTF-8 text can hold it
        (b'{"prompt": "\xff"}', None),  # not UTF-8
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),  # nested far beyond any recursion limit
        (b'{"prompt": "hi", "temperature": NaN}', None),
        (b'{"prompt": "hi", "stream_options": {"include_usage": 1}}', "stream_options"),
        (b'{"prompt": ["ok", 3]}', "prompt"),
    ],
    ids=["top_k-1e30", "seed-1e30", "max_tokens-5000-digits", "lone-surrogate", "not-utf8", "nested", "nan",
         "include_usage-int", "prompt-list-with-int"],
)
def test_odd_bodies_get_a_json_error_and_the_server_keeps_serving(server, raw, param):
    response, payload = request(server, "POST", "/v1/completions", raw=raw)
    error = json.loads(payload)["error"]
    assert response.status == 400 and error["param"] == param and error["message"]
    assert len(error["message"]) < 300  # the bad value is quoted, not echoed whole
    assert post(server, {"prompt": "still", "max_tokens": 2})[0] == 200


def test_a_content_length_of_thousands_of_digits_gets_413(server):
    connection = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Content-Length", "9" * 5000)
    connection.endheaders()
    assert connection.getresponse().status == 413
    connection.close()


def test_a_bad_request_does_not_fail_the_one_in_flight(server):
    """A top_k no tensor can hold used to reach the engine and fail the whole batch it joined."""
    host, port = server.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=30)
    body = {"prompt": "long one", "max_tokens": 100, "temperature": 0, "stream": True}
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.read1(10)  # it is in the batch now
    assert post(server, {"prompt": "bad", "top_k": 10**30})[0] == 400
    streamed = events(b"data:" + response.read().split(b"data:", 1)[1])
    connection.close()
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("error" in event for event in streamed)


@pytest.mark.timeout(120)
def test_fifty_clients_arriving_at_once_are_all_answered(server):
    """Fifty connections opened in the same instant: all are queued by the kernel and answered, none reset."""
    clients = 50
    ready = threading.Barrier(clients)
    answers: list = [None] * clients

    def client(i):
        ready.wait()
        try:
            status, payload = post(server, {"prompt": f"client {i}", "max_tokens": 2, "temperature": 0})
            answers[i] = status, payload["usage"]["completion_tokens"]
        except OSError as error:
            answers[i] = error

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [(200, 2)] * clients
