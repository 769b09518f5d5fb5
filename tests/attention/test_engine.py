"""The decode engine (nectar.attention.engine) against independent references.

* oracle: with the exact document state, the engine's logits at the prompt and at every decode step
  are the full-context model's (document + prompt + answer in one ordinary forward);
* its greedy output is transformers' ``generate`` over document + prompt;
* its static local cache decodes token for token like a transformers DynamicCache loop with the
  NECTAR attention (the engine before this one), and its graph-capturable static-shape step like
  its default step;
* a batch of prompts of different lengths gives each row the logits it gets alone (tolerance below:
  batch shapes change float summation order on some processors) and, where the top-2 margin is
  clear, the same greedy tokens;
* sampling: a row's answer depends on its seed only, not on its batch; the draws follow the
  nucleus distribution; budgets, stop ids, callbacks and exceptions behave as documented.
"""
import math

import pytest
import torch

from nectar.attention.doc_kv import prefill_document
from nectar.cache_call import cache_kwargs
from nectar.attention.engine import DecodeEngine, Request, generate
from nectar.attention.exact import ExactDocState
from nectar.attention.interface import nectar_attention
from nectar.attention.sampling import SamplingParams, sample, uniform
from nectar.layout import build_layout
from float_tolerance import FORWARD, assert_close_reordered, reorder_atol

QUESTIONS = ["Who bought the island?", "What cargo did the Meridian carry in the winter storm?", "Cargo?"]
def _clear_steps(logits, margin: float = 10.0) -> int:
    """Leading decode steps whose top-2 logit margin is clear of float noise: up to there two exact
    computations must pick the same greedy tokens; at a near-tie another summation order (another
    processor, batch shape or kernel) may flip the argmax, and everything after it legitimately differs.
    Float noise is the forward's reordering bound (float_tolerance.FORWARD of the row's largest logit),
    ``margin`` times over."""
    for step, row in enumerate(logits):
        top2 = row.float().topk(2).values
        if (top2[0] - top2[1]).item() < margin * reorder_atol(row, FORWARD):
            return step
    return len(logits)


def _setup(base, document):
    layout = build_layout(base.tokenizer, document)
    kv = prefill_document(base, layout.context_ids)
    return layout, kv, [layout.prompt(q).ids for q in QUESTIONS]


def _capture_logits(engine: DecodeEngine, requests):
    """Run the engine, recording the logits each row was sampled from (via the logits hook)."""
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(requests))}

    def hook(logits, rows):
        for j, i in enumerate(rows):
            seen[i].append(logits[j].clone())

    res = engine.run(requests, logits_hook=hook)
    return res, seen


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_engine_logits_are_the_full_context_logits_at_every_step(fixture, request, document):
    base = request.getfixturevalue(fixture)
    layout, kv, prompts = _setup(base, document)
    engine = DecodeEngine(base, ExactDocState(kv), layout.n, stop_ids=())
    res, seen = _capture_logits(engine, [Request(p, 6) for p in prompts])
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = torch.tensor([list(layout.context_ids) + p + res.tokens[i]])
            full = base.model(ids).logits[0, layout.n + len(p) - 1:-1]  # the logits each token came from
            got = torch.stack(seen[i])
            assert got.shape == full.shape
            assert_close_reordered(got, full, FORWARD, name=f"row {i}: engine logits vs the full forward")


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_engine_greedy_equals_hf_generate_over_document_and_prompt(fixture, request, document):
    base = request.getfixturevalue(fixture)
    layout, kv, prompts = _setup(base, document)
    ours = generate(base, ExactDocState(kv), layout.n, prompts, 10, stop_ids=())
    for p, toks in zip(prompts, ours.tokens):
        ids = torch.tensor([list(layout.context_ids) + p])
        out = base.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                  eos_token_id=None, output_logits=True, return_dict_in_generate=True)
        ref = out.sequences[0, ids.shape[1]:].tolist()
        clear = _clear_steps([x[0] for x in out.logits])
        assert clear >= 3, f"only {clear} steps with a clear top-2 margin: the check would say nothing"
        assert toks[:clear] == ref[:clear]


def _dynamic_cache_greedy(base, provider, n, prompt, new_tokens):
    """The reference loop: transformers' DynamicCache (grown by cat) under the NECTAR attention with
    its ordinary masks, one prompt, greedy — what the engine replaced."""
    from transformers import DynamicCache

    cache = DynamicCache(config=base.model.config)
    ids = torch.tensor([prompt])
    pos = n + torch.arange(len(prompt)).unsqueeze(0)
    out, seen = [], []
    with torch.no_grad(), nectar_attention(base.model, provider):
        logits = base.model(input_ids=ids, position_ids=pos, **cache_kwargs(base.model, cache), use_cache=True).logits[:, -1]
        for step in range(new_tokens):
            seen.append(logits[0].clone())
            tok = int(logits.argmax(-1))
            out.append(tok)
            if step == new_tokens - 1:
                break
            logits = base.model(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[n + len(prompt) + step]]),
                                **cache_kwargs(base.model, cache), use_cache=True).logits[:, -1]
    return out, seen


def test_static_cache_decode_equals_dynamic_cache_decode(tiny_qwen3, document):
    layout, kv, prompts = _setup(tiny_qwen3, document)
    provider = ExactDocState(kv)
    for p in prompts:
        ref, ref_logits = _dynamic_cache_greedy(tiny_qwen3, provider, layout.n, p, 12)
        clear = _clear_steps(ref_logits)
        assert clear >= 3, f"only {clear} steps with a clear top-2 margin: the check would say nothing"
        default = DecodeEngine(tiny_qwen3, provider, layout.n, stop_ids=()).run([Request(p, 12)])
        static = DecodeEngine(tiny_qwen3, provider, layout.n, stop_ids=(), static_shapes=True).run([Request(p, 12)])
        assert default.tokens[0][:clear] == ref[:clear] and static.tokens[0][:clear] == ref[:clear]


def test_static_shape_step_gives_the_default_steps_logits(tiny_llama, document):
    layout, kv, prompts = _setup(tiny_llama, document)
    reqs = [Request(p, 7) for p in prompts]
    _, a = _capture_logits(DecodeEngine(tiny_llama, ExactDocState(kv), layout.n, stop_ids=()), reqs)
    _, b = _capture_logits(DecodeEngine(tiny_llama, ExactDocState(kv), layout.n, stop_ids=(), static_shapes=True), reqs)
    for i in a:
        assert_close_reordered(torch.stack(b[i]), torch.stack(a[i]), FORWARD)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_batched_rows_of_different_lengths_equal_one_at_a_time(fixture, request, document):
    base = request.getfixturevalue(fixture)
    layout, kv, prompts = _setup(base, document)
    assert len({len(p) for p in prompts}) == len(prompts)  # left padding is exercised
    engine = DecodeEngine(base, ExactDocState(kv), layout.n, stop_ids=())
    reqs = [Request(p, 8) for p in prompts]
    together, seen = _capture_logits(engine, reqs)
    for i, r in enumerate(reqs):
        alone, seen_alone = _capture_logits(engine, [r])
        got, want = torch.stack(seen[i]), torch.stack(seen_alone[0])
        # tokens agree up to the first step whose top-2 margin is within float noise; the logits agree
        # through that step too (same history), after it the rows may continue differently
        clear = _clear_steps(want)
        steps = min(len(got), len(want), clear + 1)
        assert_close_reordered(got[:steps], want[:steps], FORWARD)
        assert together.tokens[i][:clear] == alone.tokens[0][:clear]


@pytest.mark.parametrize("static_shapes", [False, True])
def test_rows_leaving_the_batch_keep_their_state(tiny_llama, document, static_shapes):
    """Per-row budgets: rows finish at steps 2, 5 and 9 and leave the batch (their cache, positions
    and sampling state move into the engine's smaller buffers); every step's logits of every row
    stay the ones it gets alone."""
    layout, kv, prompts = _setup(tiny_llama, document)
    engine = DecodeEngine(tiny_llama, ExactDocState(kv), layout.n, stop_ids=(), static_shapes=static_shapes)
    reqs = [Request(prompts[0], 9), Request(prompts[1], 2), Request(prompts[2], 5)]
    res, seen = _capture_logits(engine, reqs)
    assert [len(t) for t in res.tokens] == [9, 2, 5] and res.finish_reasons == ["length"] * 3
    for i, r in enumerate(reqs):
        alone, seen_alone = _capture_logits(engine, [r])
        assert len(seen[i]) == len(seen_alone[0]) == r.max_new_tokens
        assert_close_reordered(torch.stack(seen[i]), torch.stack(seen_alone[0]), FORWARD)


def test_stop_id_ends_a_row_without_keeping_the_stop_token(tiny_llama, document):
    layout, kv, prompts = _setup(tiny_llama, document)
    kw = dict(temperature=3.0, top_p=1.0, seed=5)  # a flat distribution: varied tokens
    free = DecodeEngine(tiny_llama, ExactDocState(kv), layout.n, stop_ids=()).run([Request(prompts[0], 12, **kw)])
    toks = free.tokens[0]
    k = next(i for i in range(1, len(toks)) if toks[i] not in toks[:i])  # a token first seen at step k > 0
    engine = DecodeEngine(tiny_llama, ExactDocState(kv), layout.n, stop_ids=(toks[k],))
    res = engine.run([Request(prompts[0], 12, **kw), Request(prompts[1], 12, **kw)])
    assert res.tokens[0] == toks[:k] and res.finish_reasons[0] == "stop"
    assert toks[k] not in res.tokens[1] and res.finish_reasons[1] in ("stop", "length")


def test_on_token_streams_in_order_can_end_a_row_and_an_exception_ends_the_batch(tiny_llama, document):
    layout, kv, prompts = _setup(tiny_llama, document)
    provider = ExactDocState(kv)
    streamed: dict[int, list[int]] = {0: [], 1: []}

    def on_token(row, tok):
        streamed[row].append(tok)
        return row == 1 and len(streamed[1]) == 3  # row 1 asks to stop after its 3rd token

    res = generate(tiny_llama, provider, layout.n, prompts[:2], 8, stop_ids=(), on_token=on_token)
    assert streamed[0] == res.tokens[0] and len(res.tokens[0]) == 8
    assert streamed[1] == res.tokens[1] and len(res.tokens[1]) == 3 and res.finish_reasons[1] == "callback"

    class Cancelled(Exception):
        pass

    def cancel(row, tok):
        raise Cancelled

    before = tiny_llama.model.config._attn_implementation
    with pytest.raises(Cancelled):
        generate(tiny_llama, provider, layout.n, prompts[:2], 8, stop_ids=(), on_token=cancel)
    assert tiny_llama.model.config._attn_implementation == before  # hooks removed on the way out


def test_sampled_rows_depend_on_their_seed_not_their_batch(tiny_llama, document):
    """A row's draws are a function of its seed and token index: the same row decodes the same
    answer again, another seed gives another answer, and the sampler applied to a batch's logits
    gives each row what it gives that row alone. (Whole batched vs alone answers are not compared:
    batch shapes move float logits by ~1e-7, which can flip a sample that lands on a CDF boundary.)"""
    layout, kv, prompts = _setup(tiny_llama, document)
    provider = ExactDocState(kv)
    kw = dict(max_new_tokens=10, stop_ids=(), temperature=3.0, top_p=0.9)  # T = 3: samples differ by seed
    first = generate(tiny_llama, provider, layout.n, [prompts[0]], seed=11, **kw)
    again = generate(tiny_llama, provider, layout.n, [prompts[0]], seed=11, **kw)
    other = generate(tiny_llama, provider, layout.n, [prompts[0]], seed=99, **kw)
    assert first.tokens == again.tokens and other.tokens != first.tokens
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g) * 3
    params = SamplingParams.make([1.0, 0.0, 0.7, 2.0, 1.0], [0.9, 1.0, 0.5, 1.0, 0.3], [5, 6, 7, 8, 9],
                                 torch.device("cpu"))
    together = sample(logits, params, index=4)
    for i in range(5):
        alone = sample(logits[i:i + 1], params.select(torch.tensor([i])), index=4)
        assert alone.item() == together[i].item()


def test_sampler_follows_the_nucleus_distribution():
    """Many rows with one logit vector: empirical frequencies match the renormalised nucleus."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log().expand(20_000, -1).contiguous()
    n = logits.shape[0]
    params = SamplingParams.make([1.0] * n, [0.75] * n, range(n), torch.device("cpu"))
    tok = sample(logits, params, index=0)
    nucleus = probs[:3] / probs[:3].sum()  # 0.4 + 0.25 < 0.75 <= 0.4 + 0.25 + 0.15
    freq = torch.bincount(tok, minlength=6).float() / n
    assert freq[3:].sum() == 0
    # 5 standard errors of a binomial proportion at n = 20000
    assert all(abs(freq[i] - nucleus[i]) < 5 * math.sqrt(nucleus[i] * (1 - nucleus[i]) / n) for i in range(3))
    full = sample(logits, SamplingParams.make([1.0] * n, [1.0] * n, range(n), torch.device("cpu")), index=0)
    freq = torch.bincount(full, minlength=6).float() / n
    assert all(abs(freq[i] - probs[i]) < 5 * math.sqrt(probs[i] * (1 - probs[i]) / n) for i in range(6))


def test_uniform_draws_are_uniform_and_independent_across_indices():
    seeds = torch.arange(50_000)
    u0, u1 = uniform(seeds, 0), uniform(seeds, 1)
    assert 0 <= u0.min() and u0.max() < 1
    hist = torch.histc(u0, bins=10, min=0, max=1) / len(seeds)
    assert (hist - 0.1).abs().max() < 0.01
    assert abs(torch.corrcoef(torch.stack([u0, u1]))[0, 1].item()) < 0.02
    assert torch.equal(uniform(seeds[7:8], 3), uniform(seeds, 3)[7:8])  # a row's draw is its own


@pytest.mark.slow
def test_embedded_model_batched_greedy_equals_alone_and_hf_generate(smollm2, document):
    """On a real model greedy answers are text, not a repeated token: the batch of different-length
    prompts, each prompt alone, and transformers' generate over document + prompt agree token for
    token (compared up to the first step whose top-2 logit margin is under 1e-2, where float
    summation order may legitimately flip the argmax)."""
    layout, kv, prompts = _setup(smollm2, document)
    engine = DecodeEngine(smollm2, ExactDocState(kv), layout.n, stop_ids=())
    together, seen = _capture_logits(engine, [Request(p, 16) for p in prompts])
    assert len({tuple(t) for t in together.tokens}) == len(prompts)  # real, different answers
    for i, p in enumerate(prompts):
        alone = engine.run([Request(p, 16)]).tokens[0]
        ids = torch.tensor([list(layout.context_ids) + p])
        hf = smollm2.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                    eos_token_id=None)[0, ids.shape[1]:].tolist()
        margins = [(x.topk(2).values[0] - x.topk(2).values[1]).item() for x in seen[i]]
        clear = next((s for s, mg in enumerate(margins) if mg < 1e-2), len(margins))
        assert clear >= 4, f"row {i}: only {clear} steps with a clear margin"
        assert together.tokens[i][:clear] == alone[:clear] == hf[:clear]


@pytest.mark.parametrize("static_shapes", [False, True])
def test_requests_joining_mid_decode_get_the_logits_they_get_alone(tiny_llama, document, static_shapes):
    """Continuous batching: a short prompt runs; after 2 tokens a longer prompt joins (its prompt is
    longer than the running cache: the running rows are shifted right at the merge), after 6 another;
    the first row finishes while the others decode on. Every row sees, at every step, the logits it
    gets alone, and all rows' tokens come back under their join order's index."""
    layout, kv, prompts = _setup(tiny_llama, document)
    short, longest = sorted(prompts, key=len)[0], sorted(prompts, key=len)[-1]
    engine = DecodeEngine(tiny_llama, ExactDocState(kv), layout.n, stop_ids=(), static_shapes=static_shapes)
    first = Request(short, 8)
    later = {2: [Request(longest, 10)], 6: [Request(prompts[1], 4), Request(short, 3)]}
    checks, active_seen = [0], []

    def admit(active):
        checks[0] += 1
        active_seen.append(active)
        return later.get(checks[0], [])

    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(4)}

    def hook(logits, rows):
        for j, i in enumerate(rows):
            seen[i].append(logits[j].clone())

    res = engine.run([first], logits_hook=hook, admit=admit)
    reqs = [first, *later[2], *later[6]]
    assert [len(t) for t in res.tokens] == [8, 10, 4, 3] and res.finish_reasons == ["length"] * 4
    assert max(active_seen) == 4  # the first row and the three joiners decoded together
    for i, r in enumerate(reqs):
        alone, seen_alone = _capture_logits(engine, [r])
        assert len(seen[i]) == len(seen_alone[0]) == r.max_new_tokens
        assert_close_reordered(torch.stack(seen[i]), torch.stack(seen_alone[0]), FORWARD)


def test_rows_of_different_documents_decode_together_each_with_its_own(tiny_llama, document):
    """Per-row documents: rows reading two documents (of different lengths n) in one batch, one of
    them joining mid-decode, see the logits each gets alone with its own document."""
    other_text = " ".join(reversed(document.split()))[: len(document) // 2]
    docs = []
    for text in (document, other_text):
        layout = build_layout(tiny_llama.tokenizer, text)
        docs.append((ExactDocState(prefill_document(tiny_llama, layout.context_ids)), layout.n,
                     [layout.prompt(q).ids for q in QUESTIONS]))
    assert docs[0][1] != docs[1][1]
    (doc_a, n_a, pa), (doc_b, n_b, pb) = docs
    reqs = [Request(pa[0], 6, doc=doc_a, n=n_a), Request(pb[1], 6, doc=doc_b, n=n_b),
            Request(pb[0], 5, doc=doc_b, n=n_b)]
    engine = DecodeEngine(tiny_llama, None, 0, stop_ids=())
    calls = [0]

    def admit(active):
        calls[0] += 1
        return [reqs[2]] if calls[0] == 3 else []

    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(3)}

    def hook(logits, rows):
        for j, i in enumerate(rows):
            seen[i].append(logits[j].clone())

    engine.run(reqs[:2], logits_hook=hook, admit=admit)
    for i, (r, (doc, n, _)) in enumerate(zip(reqs, [docs[0], docs[1], docs[1]])):
        alone_engine = DecodeEngine(tiny_llama, doc, n, stop_ids=())
        _, seen_alone = _capture_logits(alone_engine, [Request(r.prompt, r.max_new_tokens)])
        assert_close_reordered(torch.stack(seen[i]), torch.stack(seen_alone[0]), FORWARD)
