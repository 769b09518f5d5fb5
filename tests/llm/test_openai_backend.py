"""The OpenAI backend against a REAL ``transformers serve`` process serving the embedded SmolLM2.

transformers serve ignores ``response_format`` (it logs "Ignoring unsupported fields"), so these
tests also exercise the tolerant-parsing path a schema-ignoring production server needs.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from nectar.llm import ChatRequest
from nectar.llm.local import LocalBackend
from nectar.llm.openai_backend import OpenAIBackend
from nectar.base_model import embedded_smollm2_dir, load_base_model
from nectar.schemas.config import ModelConfig
from nectar.ports import free_port

pytestmark = pytest.mark.slow
START_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = str(embedded_smollm2_dir())
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cli = Path(sys.executable).with_name("transformers")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([str(cli), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
                                 "--device", "cpu", "--dtype", "float32"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"transformers serve not healthy after {START_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield f"{url}/v1", model_dir
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


QUESTION = "What is the capital of France? Reply with one short sentence."
JSON_ASK = ('Reply only with JSON of the form {"city": "...", "country": "..."} for the capital of Italy.')
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
               "required": ["city", "country"], "additionalProperties": False}


def test_greedy_reply_matches_the_local_backend(served):
    """Same weights, same chat template, greedy: the server and the in-process backend agree."""
    url, model = served
    req = ChatRequest(messages=({"role": "user", "content": QUESTION},), max_new_tokens=16)
    remote = OpenAIBackend(url, model, max_concurrency=2, timeout_s=120).chat_many([req])[0]
    local = LocalBackend(load_base_model(ModelConfig())).chat_many([req])[0]
    assert remote.ok, remote.error
    assert "Paris" in remote.text
    assert remote.text.strip() == local.text.strip()
    assert remote.completion_tokens <= 16


def test_schema_ignored_by_server_is_parsed_tolerantly_and_concurrent(served):
    url, model = served
    reqs = [ChatRequest(messages=({"role": "user", "content": JSON_ASK},), json_schema=CITY_SCHEMA, max_new_tokens=24),
            ChatRequest(messages=({"role": "user", "content": "Say hello."},), max_new_tokens=6, temperature=0.7,
                        top_p=0.9, seed=1)]
    progress = []
    out = OpenAIBackend(url, model, max_concurrency=2, timeout_s=120).chat_many(
        reqs, progress=lambda d, t: progress.append(d))
    assert all(r.ok for r in out), [r.error for r in out]
    assert isinstance(out[0].parsed, dict) and "city" in out[0].parsed, out[0].text
    assert out[1].parsed is None and out[1].text
    assert sorted(progress) == [1, 2]
