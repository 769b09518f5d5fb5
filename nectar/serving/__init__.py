"""``nectar ask`` and ``nectar serve``: trained modules answering without their documents, in-process
(ask.py) or behind an OpenAI-compatible HTTP API (many documents over one base model).

app.py (routes) · openai_schemas.py (wire format) · chat_prompt.py (messages → query tokens) ·
limits.py (what a request may ask) · body_limit.py (413 middleware) · auth.py (API keys, 401) ·
metrics.py (/metrics, Prometheus) · job.py (one request in the engine) · text_stream.py (tokens →
text, stop strings) · scheduler.py (queue, continuous batching) · engine.py (the one adapter to the
decode engine) · registry.py (the served documents, modules loaded lazily under an LRU byte bound) ·
loader.py (run dirs → served runs; one run's model + module for ask) · runner.py (uvicorn, signals,
keys and exposure) · engines/ (what ``nectar serve --engine NAME`` chooses from: torch, the above;
vllm, runs' states through ``nectar.vllm``). See docs/deployment.md, "Serving modules".
"""
