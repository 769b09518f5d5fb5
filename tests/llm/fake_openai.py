"""A FAKE OpenAI-compatible server for failure injection only (garbage, 5xx, 429 with Retry-After,
400, 401, slowness).

Real-server behaviour is tested against ``transformers serve`` (test_openai_backend.py, slow).
"""
from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator

# reply(body, attempt) -> (status, payload: dict | str) or (status, payload, headers: dict)
Reply = Callable[[dict, int], tuple]


def completion(content: str, finish_reason: str = "stop") -> dict:
    return {
        "id": "fake", "object": "chat.completion", "created": 0, "model": "fake-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
    }


class FakeServer:
    def __init__(self, reply: Reply, delay_s: float = 0.0):
        self.reply = reply
        self.delay_s = delay_s
        self.bodies: list[dict] = []
        self.times: list[float] = []  # arrival time of each request (time.monotonic)
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self.url = ""

    def handle(self, body: dict) -> tuple:
        with self._lock:
            self.bodies.append(body)
            self.times.append(time.monotonic())
            attempt = len(self.bodies)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            time.sleep(self.delay_s)
            return self.reply(body, attempt)
        finally:
            with self._lock:
                self.in_flight -= 1


@contextmanager
def fake_server(reply: Reply, delay_s: float = 0.0, port: int = 0) -> Iterator[FakeServer]:
    """Serve ``reply`` on 127.0.0.1 (``port``: 0 for any; a fixed one to bring a "fixed" server back
    at the URL a run's configuration names)."""
    server = FakeServer(reply, delay_s)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep test output clean
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, payload, *extra = server.handle(body)
            data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
            self.send_response(status)
            for name, value in (extra[0] if extra else {}).items():
                self.send_header(name, str(value))
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    httpd.daemon_threads = True
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        httpd.shutdown()
        httpd.server_close()
