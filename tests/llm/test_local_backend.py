"""Local backend on the tiny random model: prefix reuse is exact, batching is invisible, seeds and
schemas are honoured, and bad requests become error results."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import xgrammar as xgr

from nectar.llm import ChatRequest, make_backend
from nectar.llm.local import LocalBackend
from nectar.base_model import load_base_model
from nectar.prompts import CONSISTENCY_SCHEMA
from nectar.schemas.config import LLMConfig, ModelConfig
from float_tolerance import FORWARD, assert_close_reordered, same_greedy_until_near_tie

DOC = "Names refer to objects. A scope defines the visibility of a name within a block. " * 12
QUESTIONS = ["What do names refer to?", "Define scope.", "What is a block?", "Why?", "Explain visibility of names."]
# Forces the greedy random model to write varied tokens (unconstrained it repeats one token).
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "minLength": 30, "maxLength": 60}},
                 "required": ["answer"], "additionalProperties": False}


def requests(**kw) -> list[ChatRequest]:
    return [ChatRequest(messages=({"role": "user", "content": DOC + "\nQuestion: " + q},), **kw) for q in QUESTIONS]


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:qwen3"])
def test_first_logits_with_prefix_reuse_match_full_forward(name):
    """The batch path (shared prefix cache + left-padded suffixes) gives the logits of a plain forward."""
    tiny = load_base_model(ModelConfig(name=name))
    for reuse in (True, False):
        be = LocalBackend(tiny, batch_size=8, reuse_prefix=reuse)
        reqs = requests(max_new_tokens=4)
        prompts = [be.encode(r) for r in reqs]
        prefix = be._shared_prefix(prompts)
        assert (prefix is not None) == reuse and (not reuse or prefix.length > 150)
        p = prefix.length if prefix else 0
        logits = be.engine(prefix).prefill_logits([x[p:] for x in prompts])  # [b, V]
        with torch.inference_mode():
            for row, ids in zip(logits, prompts):
                full = tiny.model(torch.tensor([ids])).logits[0, -1]
                assert_close_reordered(row, full, FORWARD)


def test_prefix_reuse_greedy_equals_plain_greedy_and_hf_generate(tiny):
    reqs = requests(max_new_tokens=40, json_schema=ANSWER_SCHEMA)
    shared = LocalBackend(tiny, batch_size=3).chat_many(reqs)
    plain_be = LocalBackend(tiny, batch_size=1, reuse_prefix=False)
    plain = plain_be.chat_many(reqs)
    compiled = plain_be._grammar_for()._compiled[json.dumps(ANSWER_SCHEMA)]
    for req, a, b in zip(reqs, shared, plain):
        assert a.error is None and b.error is None
        prompt = plain_be.encode(req)
        next_logits = _grammar_masked_next_logits(tiny.model, prompt, compiled)
        got = a.meta["completion_ids"]
        assert int(next_logits(got[:3]).argmax()) == got[3]  # the masked reference is the decode's
        # batch 3 with a shared prefix vs batch 1 without: token for token up to a float near-tie
        assert same_greedy_until_near_tie(next_logits, b.meta["completion_ids"], a.meta["completion_ids"])
        ids = torch.tensor([prompt])
        ref = tiny.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                  logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)])
        ref_ids = [t for t in ref[0, ids.shape[1]:].tolist() if t not in plain_be.stop_ids]
        # an independent reference: HF generate + xgrammar
        assert same_greedy_until_near_tie(next_logits, ref_ids, a.meta["completion_ids"])


def _grammar_masked_next_logits(model, prompt: list[int], compiled):
    """The reference's next-token logits after a generated prefix, masked by the schema's grammar as
    the decode was (xgrammar's processor is stateful: it is fed each step in order)."""
    def next_logits(prefix: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + prefix])
        with torch.inference_mode():
            steps = model(ids).logits[0, len(prompt) - 1:].float()  # [len(prefix) + 1, V]
        proc = xgr.contrib.hf.LogitsProcessor(compiled)
        for s in range(len(prefix) + 1):
            row = proc(ids[:, : len(prompt) + s], steps[s:s + 1].clone())
        return row[0]
    return next_logits


def test_prefix_reuse_sampling_equals_plain_sampling_per_seed(tiny):
    """Each row samples with its own seeded generator: batching and prefix reuse change nothing."""
    reqs = [ChatRequest(messages=r.messages, max_new_tokens=12, temperature=1.0, top_p=(0.9, 1.0)[i % 2], seed=i)
            for i, r in enumerate(requests())]
    shared = LocalBackend(tiny, batch_size=4).chat_many(reqs)
    plain = LocalBackend(tiny, batch_size=1, reuse_prefix=False).chat_many(reqs)
    assert [a.text for a in shared] == [b.text for b in plain]
    assert len({a.text for a in shared}) == len(reqs)  # the seeds differ, so the samples differ


def test_prefix_cache_is_reused_across_calls(tiny):
    be = LocalBackend(tiny, batch_size=4)
    be.chat_many(requests(max_new_tokens=2)[:3])
    assert (be.prefixes.misses, be.prefixes.hits) == (1, 0)
    doc_tokens = be.prefixes.longest_shared([be.encode(requests()[0])]).length
    before = be.prefill_tokens
    be.chat_many(requests(max_new_tokens=2)[3:])
    assert (be.prefixes.misses, be.prefixes.hits) == (1, 1)
    # the second call prefilled only the question suffixes, never the document again
    assert be.prefill_tokens - before < 2 * 30 < doc_tokens


def test_rows_finishing_early_leave_the_others_unchanged(tiny):
    reqs = [ChatRequest(messages=r.messages, max_new_tokens=n, temperature=1.0, seed=7)
            for r, n in zip(requests(), [3, 17, 1, 9, 30])]
    together = LocalBackend(tiny, batch_size=5).chat_many(reqs)
    assert [r.completion_tokens for r in together] == [3, 17, 1, 9, 30]
    assert all(r.finish_reason == "length" for r in together)
    alone = [LocalBackend(tiny, batch_size=1).chat_many([r])[0] for r in reqs]
    assert [r.text for r in together] == [r.text for r in alone]


def test_schema_constrained_output_always_validates(tiny):
    reqs = [ChatRequest(messages=({"role": "user", "content": f"Judge pair {i}."},), json_schema=CONSISTENCY_SCHEMA,
                        max_new_tokens=120, temperature=1.0, seed=i) for i in range(2)]
    for r in LocalBackend(tiny, batch_size=2).chat_many(reqs):
        assert r.error is None and r.finish_reason == "stop", r
        jsonschema.validate(r.parsed, CONSISTENCY_SCHEMA)
        assert list(r.parsed) == ["is_consistent", "confidence", "reasoning"]  # schema order kept
        # strict=False: xgrammar's JSON grammar admits raw control bytes (e.g. \x17) inside strings
        assert json.loads(r.text, strict=False) == r.parsed


def test_unconstrained_schema_request_is_parsed_tolerantly_or_none(tiny):
    req = ChatRequest(messages=({"role": "user", "content": "hi"},), json_schema=CONSISTENCY_SCHEMA,
                      enforce_schema=False, max_new_tokens=8)
    r = LocalBackend(tiny).chat_many([req])[0]
    assert r.error is None and r.parsed is None  # random text holds no JSON; no crash, no error


def test_too_long_prompt_is_an_error_result_not_an_exception(tiny):
    long = ChatRequest(messages=({"role": "user", "content": "word " * 5000},), max_new_tokens=8)
    ok = ChatRequest(messages=({"role": "user", "content": "short"},), max_new_tokens=3)
    seen, progress = [], []
    out = LocalBackend(tiny).chat_many([long, ok], progress=lambda d, t: progress.append((d, t)),
                                       on_result=lambda i, r: seen.append(i))
    assert out[0].error and "over the model's window of 4096 tokens" in out[0].error
    assert out[1].error is None and out[1].completion_tokens == 3
    assert sorted(seen) == [0, 1] and progress[-1] == (2, 2)


def test_make_backend_local_uses_the_base_model(tiny):
    be = make_backend(LLMConfig(backend="local", batch_size=3), ModelConfig(name="tiny:llama"))
    assert isinstance(be, LocalBackend) and be.base is tiny and be.batch_size == 3
    assert be.context_window() == 4096


def test_request_validation():
    with pytest.raises(ValueError, match="max_new_tokens"):
        ChatRequest(messages=({"role": "user", "content": "x"},), max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        ChatRequest(messages=({"role": "user", "content": "x"},), top_p=0)
