"""``nectar serve --engine vllm``'s server is the one ``VLLMServer`` of a ``ServerSpec``
(``nectar.vllm.serve.state_server_spec``): its command and environment are those the state server
had before the two server classes became one, and they reach the process (a FAKE vLLM here:
tests/llm/fake_vllm_process.py; the real one is in test_vllm_connector_server.py, slow)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from nectar.vllm.serve import CONNECTOR_MODULE, REPO_ROOT, ServedDocument, state_server_spec
from nectar.vllm.server import VLLMServer
from nectar.vllm.venv import VLLMError

FAKE = Path(__file__).parents[1] / "llm" / "fake_vllm_process.py"
DOCS = [ServedDocument("doc-a", "/states/a.safetensors", 7), ServedDocument("doc-b", "/states/b.safetensors", 9)]


def _flags(args: list[str]) -> dict[str, str | None]:
    """--flag value pairs (a flag followed by another flag has the value None)."""
    out, i = {}, 0
    while i < len(args):
        if args[i].startswith("--"):
            has_value = i + 1 < len(args) and not args[i + 1].startswith("--")
            out[args[i]] = args[i + 1] if has_value else None
            i += 2 if has_value else 1
        else:
            i += 1
    return out


def test_the_state_servers_command_is_the_one_it_had():
    spec = state_server_spec("/models/smol", DOCS, 2, served_name="nectar-smol", port=8123, dtype="float32",
                             max_model_len=2048, chat_template_path="/run/vllm/chat_template.jinja",
                             max_num_seqs=16)
    flags = _flags(spec.args(8123))
    kv = json.loads(flags.pop("--kv-transfer-config"))
    assert kv == {"kv_connector": "NectarStateConnector", "kv_connector_module_path": "nectar.vllm.connector",
                  "kv_role": "kv_consumer", "kv_connector_extra_config": {
                      "states": {"doc-a": "/states/a.safetensors", "doc-b": "/states/b.safetensors"},
                      "placeholder_id": 2}}
    assert flags == {"--model": "/models/smol", "--served-model-name": "nectar-smol", "--host": "127.0.0.1",
                     "--port": "8123", "--dtype": "float32", "--max-model-len": "2048",
                     "--enable-prefix-caching": None, "--max-logprobs": "20",
                     "--chat-template": "/run/vllm/chat_template.jinja", "--max-num-seqs": "16"}
    assert (Path(REPO_ROOT) / (CONNECTOR_MODULE.replace(".", "/") + ".py")).is_file()
    eager = state_server_spec("/models/smol", [], 2, served_name="x", enforce_eager=True, max_num_batched_tokens=512)
    flags = _flags(eager.args(1))
    assert "--kv-transfer-config" not in flags and flags["--enforce-eager"] is None
    assert flags["--max-num-batched-tokens"] == "512" and "--max-num-seqs" not in flags


def test_the_pipeline_servers_command_keeps_whole_prefills_and_its_seed():
    from nectar.vllm.server import ServerSpec

    flags = _flags(ServerSpec(model="/m", max_model_len=4096).args(9))
    assert flags["--seed"] == "0" and flags["--max-num-seqs"] == "64" and "--no-enable-chunked-prefill" in flags
    assert flags["--max-num-batched-tokens"] == "8192" and "--disable-uvicorn-access-log" in flags
    assert "--enforce-eager" in flags and "--kv-transfer-config" not in flags


def test_several_api_keys_are_refused():
    with pytest.raises(VLLMError, match="takes one API key"):
        state_server_spec("/m", DOCS, 2, served_name="x", api_keys=("a", "b"))


def test_the_key_the_checkout_and_the_binding_reach_the_process(tmp_path, monkeypatch):
    wrapper = tmp_path / "fake-vllm-python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("FAKE_VLLM_STATE", str(tmp_path / "starts"))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-63")  # the caller's own: never passed on
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    spec = state_server_spec("fake", DOCS, 2, served_name="x", api_keys=("sk-secret",), cpu_bind="0-1",
                             kv_cache_gib=3)
    assert "sk-secret" not in repr(spec) and "sk-secret" not in " ".join(spec.args(1))
    server = VLLMServer(spec, tmp_path / "server.log", python=wrapper, startup_timeout_s=60)
    with server:
        environ = dict(kv.split("=", 1) for kv in
                       (Path("/proc") / str(server.proc.pid) / "environ").read_bytes().decode().split("\0") if kv)
        assert environ["VLLM_API_KEY"] == "sk-secret"
        assert environ["PYTHONPATH"].split(":")[0] == REPO_ROOT  # vLLM imports the connector from this checkout
        assert environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
        assert environ["VLLM_CPU_KVCACHE_SPACE"] == "3"
        assert server.url.endswith("/v1") and server.version == "fake-0"
        pid = server.proc.pid
    assert not server.running and "sk-secret" not in (tmp_path / "server.log").read_text()
    with pytest.raises(ProcessLookupError):
        import os

        os.killpg(pid, 0)  # the whole group is gone


def test_the_warm_up_stamp_names_the_pipeline_server_as_it_did():
    """A compile-cache warm-up stamped before the two specs became one still matches its server."""
    from nectar.vllm.server import ServerSpec
    from nectar.vllm.warmup import _spec_key

    assert _spec_key(ServerSpec(model="/m", compile=True, port=8001)) == {
        "model": "/m", "served_name": "nectar", "dtype": "bfloat16", "max_model_len": 8192, "kv_cache_gib": 2.0,
        "seed": 0, "max_num_seqs": 64, "compile": True, "execute_timeout_s": 1800}
    keyed = state_server_spec("/m", DOCS, 2, served_name="x", api_keys=("sk-secret",))
    assert "sk-secret" not in repr(_spec_key(keyed))
