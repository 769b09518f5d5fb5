"""``nectar serve RUN_DIR… --engine vllm``: export each run's state and serve it through vLLM.

One vLLM server for the runs' shared base model; each run's document is a state the NECTAR KV
connector writes into its requests' first m cache slots (``nectar.vllm.connector``). Every
state must come from that base model (weights hash), or the command stops before starting vLLM.
The server is the project's one ``VLLMServer`` (``nectar.vllm.server``) of
``nectar.vllm.serve.state_server_spec``; this file only reads the run directories and wires them in.
"""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from ... import shutdown
from ...base_model import embedded_smollm2_dir
from ...layout import build_layout
from ...orchestration.context import open_run
from ...vllm.serve import ServedDocument, chat_template, placeholder_token, state_server_spec
from ...vllm.server import ServerSpec, VLLMServer
from ...vllm.state import ExportedState, NotPlainKV, check_state, verify_state
from ...vllm.venv import VLLMError, ensure_plugin, interpreter
from .interface import EngineError, EngineUsageError, Log, ServeOptions
from .vllm_export import export_run_state


@dataclass(frozen=True)
class VLLMOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "bfloat16"
    max_model_len: int = 4096
    kv_cache_gib: int = 2
    enforce_eager: bool = False
    served_name: str | None = None
    source: str | None = None  # None: the trained module (β: NECTAR backend); attention_matching_kv@intN: the refit
    max_logprobs: int = 20
    max_num_seqs: int | None = None  # vLLM's running batch (``nectar serve --max-batch``)
    api_keys: tuple[str, ...] = ()  # at most one (VLLM_API_KEY)
    python: str | None = None  # vLLM's python (None: NECTAR_VLLM_PYTHON, else the managed venv's, never built here)
    startup_timeout_s: float = 1200.0


def model_path(name: str) -> str:
    """The folder vLLM loads: the embedded model's, or the run's model folder (tiny:* cannot be served)."""
    if name == "embedded:smollm2-135m":
        return str(embedded_smollm2_dir())
    if name.startswith(("tiny:", "embedded:")):
        raise NotPlainKV(f"model {name!r} has no model folder vLLM can load; serve a run of a Hugging Face model")
    return name


def check_same_base(states: list[tuple[str, ExportedState]]) -> None:
    """Every state must come from the first one's base model (vLLM serves one model)."""
    first_dir, first = states[0]
    for run_dir, st in states[1:]:
        check_state(st.path, first.base_model_hash)  # raises naming both models


def prepare(run_dirs: list[str], opts: VLLMOptions, log=print) -> tuple[ServerSpec, str, list[ServedDocument]]:
    """Export/verify every run's state → (the server's spec, its log path, the documents)."""
    states = [(d, export_run_state(d, opts.source, log)) for d in run_dirs]
    for run_dir, st in states:
        verify_state(st.path)
        log(f"{run_dir}: state {st.source!r}{' with β (NECTAR attention backend)' if st.bias else ' (plain KV)'}, "
            f"m={st.m} pseudo-tokens per layer for the document's n={st.n} tokens")
    check_same_base(states)
    ctx = open_run(run_dirs[0])
    from transformers import AutoTokenizer

    path = model_path(states[0][1].base_model)
    tok = AutoTokenizer.from_pretrained(path)
    pid, ptext = placeholder_token(tok)
    docs = [ServedDocument(st.doc_id, st.path, st.m, st.bias) for _, st in states]
    if len({d.doc_id for d in docs}) != len(docs):
        raise NotPlainKV("two runs of the same document: serve one run per document")
    out_dir = os.path.dirname(states[0][1].path)
    template = os.path.join(out_dir, "chat_template.jinja")
    with open(template, "w") as f:
        f.write(chat_template(build_layout(tok, ctx.text), docs, ptext))
    name = opts.served_name or "nectar-" + states[0][1].base_model.split("/")[-1].replace(":", "-")
    spec = state_server_spec(path, docs, pid, served_name=name, port=opts.port, host=opts.host, dtype=opts.dtype,
                             max_model_len=opts.max_model_len, chat_template_path=template,
                             enforce_eager=opts.enforce_eager, max_logprobs=opts.max_logprobs,
                             max_num_seqs=opts.max_num_seqs, kv_cache_gib=opts.kv_cache_gib, api_keys=opts.api_keys)
    return spec, os.path.join(out_dir, "server.log"), docs


@contextmanager
def measured_server(run_dir: str, opts: VLLMOptions, log=print) -> Iterator[tuple[VLLMServer, ServerSpec, ServedDocument]]:
    """One run's state (``opts.source``) served by a vLLM server this process owns, for measuring it (the
    fidelity benchmark, ``nectar compare``'s ``vllm:`` rows): started with NECTAR's plugin (β states need its
    backend; every state server its prompt log-probs), stopped by its process group on leaving the block —
    an error or a SIGINT/SIGTERM raised under ``shutdown.handling_signals`` included — and by a cleanup
    registered with ``nectar.shutdown`` in case the process is forced to exit (``os._exit`` runs no atexit)."""
    spec, log_path, docs = prepare([run_dir], opts, log)
    python = opts.python or interpreter(build=False)  # never a 3.4 GB build unasked: `nectar llm setup` builds it
    ensure_plugin(python)
    server = VLLMServer(spec, log_path, python=python, startup_timeout_s=opts.startup_timeout_s)
    cleanup = shutdown.register(lambda fast: server.stop(grace_s=0.0 if fast else 20.0), f"vLLM server ({log_path})")
    try:
        server.start()
        yield server, spec, docs[0]
    finally:
        server.stop()
        cleanup.remove()


def serve_vllm(run_dirs: list[str], opts: VLLMOptions, log=print) -> None:
    """Run vLLM until SIGTERM/SIGINT (or until it exits: an error), then stop its whole process group."""
    spec, log_path, docs = prepare(run_dirs, opts, log)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before vLLM starts: a signal never orphans it
        signal.signal(sig, lambda *_: stop.set())
    # `nectar llm setup` builds the venv: serving never starts a 3.4 GB build unasked
    python = opts.python or interpreter(build=False)
    ensure_plugin(python)  # the entry point of NECTAR's plugin in vLLM's processes (attention backend, prompt log-probs)
    server = VLLMServer(spec, log_path, python=python, startup_timeout_s=opts.startup_timeout_s)
    try:
        log(f"starting vLLM (its own process group; log {log_path}) …")
        server.start()
        log(f"serving {len(docs)} document(s) on {server.url} model={spec.served_name!r} (vLLM pid {server.proc.pid})")
        for d in docs:
            log(f"  document {d.doc_id}: m={d.m} pseudo-tokens; send cache_salt={d.doc_id!r} "
                f"(chat: chat_template_kwargs={{'document': {d.doc_id!r}}})")
        while not stop.wait(1.0):
            if not server.running:
                raise VLLMError(f"vLLM exited with status {server.proc.returncode}; see {log_path}")
    finally:
        server.stop()


class VLLMEngine:
    name = "vllm"
    help = "vLLM's engine with each document's state, β included (docs/deployment.md §14–15)"

    def serve(self, run_dirs: list[str], opts: ServeOptions, log: Log) -> None:
        from ..runner import Unauthenticated, api_keys, check_exposure

        if len(opts.served_name) > 1:
            raise EngineUsageError("--engine vllm serves every document under one model id (clients pick the "
                                   "document by cache_salt); give --served-name once")
        try:
            keys = api_keys(list(opts.api_key))
            check_exposure(opts.host, keys, opts.allow_unauthenticated)
            serve_vllm(run_dirs, VLLMOptions(opts.host, opts.port, opts.dtype, opts.max_model_len, opts.kv_cache_gib,
                                             opts.enforce_eager, opts.served_name[0] if opts.served_name else None,
                                             source=opts.state, max_num_seqs=opts.max_batch, api_keys=keys), log=log)
        except (NotPlainKV, VLLMError, FileNotFoundError, ValueError, Unauthenticated) as exc:
            raise EngineError(str(exc)) from exc
