"""Local backend on the embedded SmolLM2-135M: prefix reuse is exact on a real model and document."""
from __future__ import annotations

import jsonschema
import pytest
import torch

from nectar.documents import load_document
from nectar.llm import ChatRequest
from nectar.llm.local import LocalBackend
from nectar.base_model import load_base_model
from nectar.prompts import CONSISTENCY_SCHEMA, answer_prompt
from nectar.schemas.config import ModelConfig
from float_tolerance import same_greedy_until_near_tie

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    return load_base_model(ModelConfig())


def test_prefix_reuse_greedy_equals_plain_greedy_on_a_real_document(smollm):
    text, _ = load_document("pydoc:naming")
    doc = " ".join(text.split()[:250])  # a short document keeps the no-reuse baseline quick
    questions = ["What is a code block?", "What happens when a name is not found at all?", "What is a scope?"]
    reqs = [ChatRequest(messages=({"role": "user", "content": answer_prompt(doc, q)},), max_new_tokens=16)
            for q in questions]
    shared_be = LocalBackend(smollm, batch_size=3)
    shared = shared_be.chat_many(reqs)
    plain = LocalBackend(smollm, batch_size=1, reuse_prefix=False).chat_many(reqs)
    assert shared_be.prefixes.misses == 1 and shared_be.prefixes.longest_shared(
        [shared_be.encode(r) for r in reqs]).length > 300
    for req, a, b in zip(reqs, shared, plain):
        assert a.ok and a.completion_tokens > 3
        prompt = shared_be.encode(req)

        def next_logits(prefix: list[int], prompt=prompt) -> torch.Tensor:
            with torch.inference_mode():
                return smollm.model(torch.tensor([prompt + prefix])).logits[0, -1]

        # token for token, up to a float near-tie (batched with a shared prefix vs alone without)
        assert same_greedy_until_near_tie(next_logits, b.meta["completion_ids"], a.meta["completion_ids"])
    assert len({a.text for a in shared}) == 3  # real answers differ per question


def test_judge_output_is_schema_valid_on_the_real_model(smollm):
    prompt = ("Are these consistent? Answer as JSON with is_consistent, confidence, reasoning.\n"
              "A: Paris is the capital of France.\nB: The capital of France is Paris.")
    req = ChatRequest(messages=({"role": "user", "content": prompt},), json_schema=CONSISTENCY_SCHEMA,
                      max_new_tokens=96)
    r = LocalBackend(smollm).chat_many([req])[0]
    assert r.ok and r.finish_reason == "stop", r
    jsonschema.validate(r.parsed, CONSISTENCY_SCHEMA)
