"""``nectar ask`` and ``nectar serve``: a trained module answering without the document, in-process
(ask.py) or behind an OpenAI-compatible HTTP API.

app.py (routes) · openai_schemas.py (wire format) · chat_prompt.py (messages → query tokens) ·
limits.py (what a request may ask) · body_limit.py (413 middleware) · job.py (one request in the
engine) · text_stream.py (tokens → text, stop strings) · scheduler.py (queue, dynamic batching) ·
engine.py (the one adapter to the decode engine) · loader.py (run dir → model + module) ·
runner.py (uvicorn, signals). See docs/deployment.md, "Serving a module".
"""
