"""Targets: recorded (q, α, A) equal an independent computation, the Zarr layout validates, and a
killed run resumes from the last completed shard."""
import numpy as np
import pytest
import torch

from nectar.attention.doc_kv import prefill_document
from nectar.cache_call import cache_kwargs
from nectar.layout import build_layout
from nectar.schemas import DatasetRow, TargetsConfig, TargetsPairRow
from nectar.stages import targets as targets_stage
from nectar.tables import ArtifactError, read_table
from nectar.targets.store import open_targets
from float_tolerance import FORWARD, close_reordered


def _rows(k=5):
    qa = [("Who bought the island?", "Ilse Brandt."), ("What ran aground?", "The schooner Meridian."),
          ("What cargo?", "Salt cod and lamp oil."), ("How many sailors?", "Seven."),
          ("When?", "In the winter of 1871."), ("Where?", "On the northern reef.")]
    return [DatasetRow(pair_id=f"p{i}", chunk_id=0, task="qa", instruction=a, response=b, full_answer=b,
                       judge_raw="{}", is_consistent=True, confidence=0.9, reasoning="", verdict="consistent",
                       kept=True, split="train" if i < k - 1 else "test") for i, (a, b) in enumerate(qa[:k])]


def _independent_alpha_A(base, layout, ids, layer):
    """Softmax over the document's keys from the ordinary forward's cache (no NECTAR code)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=base.model.config)
    captured = {}
    attn = base.model.model.layers[layer].self_attn
    hook = attn.register_forward_hook(lambda mod, args, kw, out: None, with_kwargs=True)
    hook.remove()
    full = torch.tensor([list(layout.context_ids) + ids])
    # Rotated queries: re-run q_proj/norm/rope on the layer input captured by a pre-hook.
    def pre(mod, args, kwargs):
        captured["h"] = kwargs["hidden_states"]
        captured["pe"] = kwargs["position_embeddings"]
    h = attn.register_forward_pre_hook(pre, with_kwargs=True)
    with torch.no_grad():
        base.model(full, **cache_kwargs(base.model, cache), use_cache=True)
    h.remove()
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hs = captured["h"]
    b, T, _ = hs.shape
    q = attn.q_proj(hs).view(b, T, -1, base.head_dim)
    if hasattr(attn, "q_norm"):  # Qwen3 normalises each query head before the rotation
        q = attn.q_norm(q)
    q = q.transpose(1, 2)
    cos, sin = captured["pe"]
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    k = cache.layers[layer].keys[:, :, : layout.n]
    v = cache.layers[layer].values[:, :, : layout.n]
    g = base.num_q_heads // base.num_kv_heads
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    logits = q[:, :, layout.n:] @ k.transpose(-1, -2) * base.scaling
    return torch.logsumexp(logits, -1)[0].T, (torch.softmax(logits, -1) @ v)[0].transpose(0, 1), q[0, :, layout.n:].transpose(0, 1)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_qwen3_yarn"])
def test_targets_match_independent_computation_and_validate(fixture, request, document, tmp_path):
    base = request.getfixturevalue(fixture)  # every supported family (and the paper's YaRN x4), same checks
    layout = build_layout(base.tokenizer, document)
    kv = prefill_document(base, layout.context_ids)
    cfg = TargetsConfig(top_k=4, chunk_tokens=8, shard_tokens=32, batch_size=2)
    counts = targets_stage.build_targets(base, layout, kv, _rows(), cfg, str(tmp_path), "sha")
    g, header = open_targets(str(tmp_path / "targets.zarr"))
    assert header.complete and counts["pairs"] == 5 and header.split_pairs == {"train": 4, "test": 1}
    pairs = read_table(str(tmp_path / "pairs.parquet"), TargetsPairRow)
    offsets = g["pair_offsets"][:]
    assert offsets[-1] == header.n_tokens == sum(p.length for p in pairs)
    for p in pairs:  # every pair, wherever it sits in its packed batch
        ids = g["token_ids"][p.start:p.start + p.length].tolist()
        assert g["positions"][p.start:p.start + p.length].tolist() == list(range(layout.n, layout.n + p.length))
        for layer in range(base.num_layers):
            alpha, A, q = _independent_alpha_A(base, layout, ids, layer)
            sl = slice(p.start, p.start + p.length)
            # packed batches against one sequence alone: the same forward in another packing
            assert close_reordered(g["alpha"][sl][:, layer], alpha, FORWARD)
            assert close_reordered(g["A"][sl][:, layer], A, FORWARD)
            assert close_reordered(g["q"][sl][:, layer], q, FORWARD)
    p = pairs[2]
    ids = g["token_ids"][p.start:p.start + p.length].tolist()
    # teacher top-k are the full-context model's log-probs
    with torch.no_grad():
        ref = torch.log_softmax(base.model(torch.tensor([list(layout.context_ids) + ids])).logits[0, layout.n:], -1)
    top = g["topk_logprobs"][p.start:p.start + p.length]
    # stored where the KL loss reads them (the next token is a response token), zeros elsewhere
    assert header.topk_scope == "kl_positions"
    kl = np.zeros(p.length, dtype=bool)
    kl[max(p.response_start - 1, 0): p.length - 1] = True
    assert kl.any() and not kl.all()
    assert close_reordered(top[kl], ref.topk(4, -1).values.numpy()[kl], FORWARD)
    assert (top[~kl] == 0).all()
    assert (g["topk_ids"][p.start:p.start + p.length][kl] == ref.topk(4, -1).indices.numpy()[kl]).mean() > 0.9
    mask = g["response_mask"][p.start:p.start + p.length]
    assert not mask[: p.response_start].any() and mask[p.response_start:].all()


def test_targets_resume_after_kill_reproduces_uninterrupted(tiny_llama, document, tmp_path):
    layout = build_layout(tiny_llama.tokenizer, document)
    kv = prefill_document(tiny_llama, layout.context_ids)
    cfg = TargetsConfig(top_k=4, chunk_tokens=8, shard_tokens=16, batch_size=1)
    targets_stage.build_targets(tiny_llama, layout, kv, _rows(6), cfg, str(tmp_path / "a"), "sha")

    calls = {"n": 0}

    def killer(done, total):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # the run is killed mid-stage

    with pytest.raises(KeyboardInterrupt):
        targets_stage.build_targets(tiny_llama, layout, kv, _rows(6), cfg, str(tmp_path / "b"), "sha", progress=killer)
    g, header = open_targets(str(tmp_path / "b" / "targets.zarr"))
    assert not header.complete and 0 < g.attrs["written_tokens"] < header.n_tokens
    targets_stage.build_targets(tiny_llama, layout, kv, _rows(6), cfg, str(tmp_path / "b"), "sha")
    ga, _ = open_targets(str(tmp_path / "a" / "targets.zarr"))
    gb, hb = open_targets(str(tmp_path / "b" / "targets.zarr"))
    assert hb.complete
    for name in ("q", "alpha", "A", "topk_ids", "token_ids", "response_mask"):
        assert np.array_equal(ga[name][:], gb[name][:]), name


def test_a_resume_mid_batch_leaves_the_uninterrupted_groups_files_and_no_half_written_one(tiny_llama, document,
                                                                                       tmp_path):
    """The stop lands inside a batch of three pairs and a killed write left zarr's temporary file;
    the resumed group has the uninterrupted one's files, byte for byte (so the same digest)."""
    import fsspec

    from nectar.integrity import digest_outputs, output_digest

    layout = build_layout(tiny_llama.tokenizer, document)
    kv = prefill_document(tiny_llama, layout.context_ids)
    cfg = TargetsConfig(top_k=4, chunk_tokens=8, shard_tokens=16, batch_size=3)
    targets_stage.build_targets(tiny_llama, layout, kv, _rows(6), cfg, str(tmp_path / "a"), "sha")

    def stop_after_first_batch(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        targets_stage.build_targets(tiny_llama, layout, kv, _rows(6), cfg, str(tmp_path / "b"), "sha",
                                    progress=stop_after_first_batch)
    g, header = open_targets(str(tmp_path / "b" / "targets.zarr"))
    first_batch = sum(r.length for r in read_table(str(tmp_path / "a" / "pairs.parquet"), TargetsPairRow)[:3])
    assert g.attrs["written_tokens"] < first_batch  # on disk: whole shards only, the batch's tail is not
    # FAILURE INJECTION: a write killed between zarr's temporary file and its rename
    stale = tmp_path / "b" / "targets.zarr" / "q" / "c" / "9.0123456789abcdef.partial"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"half a shard")
    targets_stage.build_targets(tiny_llama, layout, kv, _rows(6), cfg, str(tmp_path / "b"), "sha")
    assert not stale.exists()
    fs = fsspec.filesystem("file")
    digests = [output_digest(digest_outputs(fs, str(tmp_path / run), ["targets.zarr"]), "targets.zarr")
               for run in ("a", "b")]
    assert digests[0] == digests[1]


def test_empty_dataset_and_bad_header_rejected(tiny_llama, document, tmp_path):
    layout = build_layout(tiny_llama.tokenizer, document)
    kv = prefill_document(tiny_llama, layout.context_ids)
    rows = [r.model_copy(update={"kept": False, "split": "dropped"}) for r in _rows()]
    with pytest.raises(targets_stage.TargetsInputError, match="no kept"):
        targets_stage.build_targets(tiny_llama, layout, kv, rows, TargetsConfig(), str(tmp_path), "sha")
    with pytest.raises(ArtifactError, match="no targets group"):
        open_targets(str(tmp_path / "missing.zarr"))


def test_background_and_inline_shard_writes_give_the_same_group(tiny_llama, document, tmp_path, monkeypatch):
    """The writer thread runs only when a core is free for it; both ways store identical targets."""
    layout = build_layout(tiny_llama.tokenizer, document)
    kv = prefill_document(tiny_llama, layout.context_ids)
    cfg = TargetsConfig(top_k=4, chunk_tokens=8, shard_tokens=16, batch_size=2)
    groups = {}
    for background in (True, False):
        monkeypatch.setattr(targets_stage, "_spare_core", lambda device, bg=background: bg)
        out = tmp_path / str(background)
        targets_stage.build_targets(tiny_llama, layout, kv, _rows(6), cfg, str(out), "sha")
        groups[background], header = open_targets(str(out / "targets.zarr"))
        assert header.complete and groups[background].attrs["written_tokens"] == header.n_tokens
    for name in ("q", "alpha", "A", "topk_ids", "topk_logprobs", "token_ids", "positions", "response_mask"):
        assert np.array_equal(groups[True][name][:], groups[False][name][:]), name
