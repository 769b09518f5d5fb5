"""vLLM: the one place that starts, keeps and stops vLLM servers, and the file a document's state
travels in to them (core layer: no run directories, no stages).

venv.py         vLLM's own venv (pinned; built by ``nectar.venvs``) and ``interpreter()``: which python runs vLLM
server.py       ``ServerSpec`` and the one ``VLLMServer`` (process group, health, death, restart, compile cache)
pool.py         the servers of one pipeline run, shared by its stages (``server_scope``, ``acquire``)
warmup.py       warming the compile cache at setup (``nectar llm setup``)
notices.py      one-line notices about the servers, on stderr
serve.py        ``nectar serve --engine vllm``'s server: placeholders, chat template, ``state_server_spec``
format.py       the state file's format (safetensors only: the connector reads it inside vLLM's venv)
state.py        a plain-KV state: which modules are one, keys re-rotated, the file written and checked
connector.py    the KV connector vLLM loads (``--kv-transfer-config``); imports only torch, safetensors, vLLM

Three vLLM files live elsewhere, each because this package sits below its folder: the chat backend
over a vLLM server, ``nectar.llm.vllm_backend`` (one of the LLM backends; ``nectar.llm`` starts and
pools servers from here); the check that vLLM with a state answers as the torch engine,
``nectar.evaluation.vllm_equivalence`` (it uses evaluation's paired bootstrap, and evaluation reaches
this package through the judge's LLM backend); and the serving engine that exports runs' states and
serves them, ``nectar.serving.engines.vllm`` + ``vllm_export`` (they read run directories).

This file imports nothing: vLLM's own process imports ``nectar.vllm.connector`` through it.
"""
