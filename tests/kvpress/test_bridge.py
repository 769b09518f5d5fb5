"""The kvpress bridge end to end on the tiny model (saved to a folder kvpress loads), its guard against a
deliberately mismatched model, and the byte-budget arithmetic and press names (fast)."""
import pytest
import torch

from nectar.attention.doc_kv import prefill_document
from nectar.comparison.systems import kvpress_systems
from nectar.evaluation.teacher import EvalPair, teacher_forced_pair_sums
from nectar.attention.exact import ExactDocState
from nectar.kvpress import (GUARD_TOLERANCE, PRESSES, UNAVAILABLE, KvpressError, PressJob, compression_ratio,
                            score_presses)
from nectar.kvpress.bridge import model_folder
from nectar.layout import build_layout
from nectar.quantization import quantized_nbytes
from nectar.schemas import ModelConfig
from nectar.schemas.presets import ConfigError

QA = [("Who bought the island?", "Captain Ilse Brandt bought Varn Island."),
      ("What ran aground?", "The schooner Meridian ran aground on the northern reef."),
      ("How many sailors were saved?", "Seven sailors were rowed ashore.")]


@pytest.fixture(scope="module")
def tiny_doc(tiny_llama):
    from sample_document import DOC

    layout = build_layout(tiny_llama.tokenizer, DOC)
    pairs = []
    for i, (q, a) in enumerate(QA):
        t = layout.pair(q, a)
        pairs.append(EvalPair(f"p{i}", "qa", ("test",), tuple(t.ids), t.response_start))
    return layout, prefill_document(tiny_llama, layout.context_ids), pairs


@pytest.mark.slow
def test_presses_score_the_exact_pairs_against_our_full_model(kvpress_env, tiny_llama, tiny_doc, tmp_path):
    layout, doc_kv, pairs = tiny_doc
    cfg = ModelConfig(name="tiny:llama", device="cpu")
    names = ["kvzip", "kvzip_layerwise", "adakv_expected_attention", "snapkv", "streaming_llm", "knorm"]
    jobs = [PressJob(f"kvpress:{p}@0.3", p, 0.3) for p in names] + [PressJob("kvzip@0.9", "kvzip", 0.9),
                                                                      PressJob("kvzip:int4@0.05", "kvzip", 0.05, 4),
                                                                      PressJob("kvzip:int4@0.2", "kvzip", 0.2, 4)]
    res = score_presses(tiny_llama, cfg, list(layout.context_ids), doc_kv, pairs, jobs, tmp_path)
    # int4 at ρ = 0.2 would keep 107 % of the entries: that job alone is left out, with the reason
    assert list(res.errors) == ["kvzip:int4@0.2"] and "keeps 107%" in res.errors["kvzip:int4@0.2"]
    assert 0 <= res.guard_max_kl <= GUARD_TOLERANCE
    ours = teacher_forced_pair_sums(tiny_llama, {"full": ExactDocState(doc_kv), "none": None}, pairs, layout.n)
    n, L, H, d = layout.n, tiny_llama.num_layers, tiny_llama.num_kv_heads, tiny_llama.head_dim
    # int4 with head_dim 16: one group of 16 values a row, 8 bytes of codes + 4 of fp16 scale and zero
    int4_row = quantized_nbytes((d,), 4, 64)
    assert int4_row == 12
    for key, r in res.results.items():
        # the same response tokens as this project's scoring, and a compressed cache differs from the full one
        assert r.sums.n.tolist() == ours["full"].n.tolist()
        assert (r.sums.kl >= 0).all() and r.sums.kl.sum() > 10 * res.guard_max_kl
        share = r.kept_entries / (L * H * n)
        want = {"kvzip@0.9": 0.9, "kvzip:int4@0.05": 0.05 * 4 * d / int4_row}.get(key, 0.3)
        assert abs(share - want) < 0.02 + 1 / n, (key, share)
        row = int4_row if key == "kvzip:int4@0.05" else d * 4
        assert r.state_bytes == r.kept_entries * 2 * row and r.press_s > 0
        assert abs(r.state_bytes / (L * H * n * 2 * d * 4) - {"kvzip@0.9": 0.9}.get(key, 0.3 if "@0.3" in key
                                                                                      else 0.05)) < 0.02 + 1 / n
    # keeping 90 % of the entries is closer to the full model than keeping 30 %
    kl = {k: r.sums.kl.sum() for k, r in res.results.items()}
    assert kl["kvzip@0.9"] < kl["kvpress:kvzip@0.3"]


@pytest.mark.slow
def test_kvzip_jobs_scored_once_keep_what_a_pass_of_their_own_keeps(kvpress_env, tiny_llama, tiny_doc, tmp_path):
    """Every KVzip job (budgets, precisions, the layer-wise variant) selecting from one scoring pass gets the
    same kept entries and the same per-pair sums, bit for bit, as a press pass per job."""
    layout, doc_kv, pairs = tiny_doc
    cfg = ModelConfig(name="tiny:llama", device="cpu")
    jobs = [PressJob("kvzip@0.3", "kvzip", 0.3), PressJob("kvzip@0.6", "kvzip", 0.6),
            PressJob("kvzip:int4@0.05", "kvzip", 0.05, 4), PressJob("kvzip:int8@0.1", "kvzip", 0.1, 8),
            PressJob("kvzip_layerwise@0.3", "kvzip_layerwise", 0.3), PressJob("snapkv@0.3", "snapkv", 0.3)]
    once = score_presses(tiny_llama, cfg, list(layout.context_ids), doc_kv, pairs, jobs, tmp_path / "once")
    each = score_presses(tiny_llama, cfg, list(layout.context_ids), doc_kv, pairs, jobs, tmp_path / "each",
                         score_once=False)
    assert not once.errors and not each.errors and set(once.results) == {j.key for j in jobs}
    for key, r in once.results.items():
        e = each.results[key]
        assert r.kept_entries == e.kept_entries and r.state_bytes == e.state_bytes, key
        for field in ("correct", "nll", "kl", "n"):
            assert getattr(r.sums, field).tolist() == getattr(e.sums, field).tolist(), (key, field)
    # the budgets differ, so the shared pass really served different selections
    assert once.results["kvzip@0.3"].kept_entries < once.results["kvzip@0.6"].kept_entries
    raw = __import__("json").loads((tmp_path / "once" / "result.json").read_text())["jobs"]
    assert raw["kvzip@0.6"]["scored_once"] and not raw["snapkv@0.3"]["scored_once"]


@pytest.mark.slow
def test_guard_refuses_every_row_on_a_deliberately_mismatched_model(kvpress_env, tiny_llama, tiny_doc, tmp_path):
    from transformers import AutoModelForCausalLM

    layout, doc_kv, pairs = tiny_doc
    cfg = ModelConfig(name="tiny:llama", device="cpu")
    wrong = AutoModelForCausalLM.from_pretrained(model_folder(tiny_llama, cfg))
    with torch.no_grad():
        wrong.model.layers[0].self_attn.v_proj.weight.mul_(3.0)  # a different model under the same name
    wrong.save_pretrained(tmp_path / "mismatched")
    tiny_llama.tokenizer.save_pretrained(tmp_path / "mismatched")
    jobs = [PressJob("kvpress:knorm@0.3", "knorm", 0.3)]
    res = score_presses(tiny_llama, cfg, list(layout.context_ids), doc_kv, pairs, jobs, tmp_path / "work",
                        model_dir=tmp_path / "mismatched")
    assert res.guard_max_kl > GUARD_TOLERANCE and not res.results
    assert "disagree" in res.errors["kvpress:knorm@0.3"] and f"{GUARD_TOLERANCE:g}" in res.errors["kvpress:knorm@0.3"]


def test_byte_budget_sets_the_kept_share():
    assert compression_ratio(0.05, 64, 32) == pytest.approx(0.95)
    assert compression_ratio(0.05, 64, 32, kv_bytes_per_value=2) == pytest.approx(0.975)  # a bf16 KV
    with pytest.raises(KvpressError, match="keeps 200% of the document's entries"):
        compression_ratio(2.0, 64, 32)


def test_press_names_resolve_and_hub_presses_are_listed_unavailable():
    assert [s.name for s in kvpress_systems("kvpress:kvzip")] == ["kvpress:kvzip"]
    every = kvpress_systems("kvpress:all:int4")
    assert len(every) == len(PRESSES) and all(s.bits == 4 and s.kind == "kvpress" for s in every)
    for name in ("kvzip", "kvzip_layerwise", "expected_attention", "adakv_expected_attention", "snapkv",
                 "streaming_llm", "knorm", "tova"):
        assert name in PRESSES
    with pytest.raises(ConfigError, match="unavailable offline: DuoAttentionPress downloads"):
        kvpress_systems("kvpress:duo_attention")
    with pytest.raises(ConfigError, match="unknown kvpress press 'nope'.*unavailable offline: duo_attention"):
        kvpress_systems("kvpress:nope")
    with pytest.raises(ConfigError, match="precision 'int3'"):
        kvpress_systems("kvpress:knorm:int3")
    assert set(UNAVAILABLE).isdisjoint(PRESSES)



def test_the_worker_loads_the_folder_with_the_runs_rope(tiny_llama, tiny_llama_yarn, tmp_path):
    """The embedded model's folder has no RoPE scaling; a run with model.yarn_factor applies it at load.
    The request carries the run's RoPE and the worker's config takes it, so kvpress rotates positions as
    our model does — without it the guard refused every row of a 7.7k-token document (KL 4.6; the tiny
    random model's near-uniform outputs hide the difference, so this checks the rotary itself)."""
    import torch
    from transformers import AutoModelForCausalLM

    from nectar.kvpress.bridge import request
    from nectar.kvpress.worker import model_config

    import copy

    # the folder as the embedded model's is: no scaling (a copy: save_pretrained changes the shared
    # session model's state, which tests/test_weights_hash.py then sees)
    copy.deepcopy(tiny_llama.model).save_pretrained(tmp_path / "plain")
    req, _ = request(tiny_llama_yarn, tmp_path / "plain", [1, 2, 3], [], [], None)
    assert req["rope_parameters"]["rope_type"] == "yarn" and req["max_position_embeddings"] == 8192
    loaded = AutoModelForCausalLM.from_config(model_config(req)).model.rotary_emb
    ours = tiny_llama_yarn.model.model.rotary_emb
    assert loaded.rope_type == "yarn" and loaded.attention_scaling == ours.attention_scaling
    assert torch.allclose(loaded.inv_freq, ours.inv_freq)
    plain, _ = request(tiny_llama, tmp_path / "plain", [1, 2, 3], [], [], None)
    assert model_config(plain).rope_parameters["rope_type"] == "default"
