"""Reconstruction spans as a targets split of their own: captured with every other pair, split code
``recon``, never an evaluated (held-out) split."""
import hashlib
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "training"))
from targets_fixture import DOC, dataset_rows  # noqa: E402

from nectar.attention.doc_kv import prefill_document  # noqa: E402
from nectar.evaluation.selection import Selection, split_pools, with_subset  # noqa: E402
from nectar.documents import load_document  # noqa: E402
from nectar.layout import build_layout  # noqa: E402
from nectar.schemas.artifacts import SPLIT_CODES, TargetsPairRow  # noqa: E402
from nectar.schemas.config import EvaluateConfig, ProbesConfig, ReconConfig, TargetsConfig  # noqa: E402
from nectar.queries.probes import split_units  # noqa: E402
from nectar.queries.probes import make_probes  # noqa: E402
from nectar.queries.recon import make_recon, recon_dataset_rows, withheld_probes, withheld_units  # noqa: E402
from nectar.stages.targets import build_targets  # noqa: E402
from nectar.tables import read_table  # noqa: E402
from nectar.targets.store import open_targets  # noqa: E402
from nectar.training.data import TargetsData  # noqa: E402


def test_recon_split_is_captured_as_its_own_split_and_not_evaluated(tiny_llama, tmp_path):
    layout = build_layout(tiny_llama.tokenizer, DOC)
    kv = prefill_document(tiny_llama, layout.context_ids)
    spans = make_recon(DOC, ReconConfig(span_words=12, withheld_fraction=0.0), ProbesConfig(block_units=1))
    cfg = TargetsConfig(top_k=8, max_query_tokens=96, chunk_tokens=16, shard_tokens=64, batch_size=4)
    out = str(tmp_path)
    build_targets(tiny_llama, layout, kv, dataset_rows() + recon_dataset_rows(spans), cfg, out,
                  hashlib.sha256(DOC.encode()).hexdigest())
    rows = read_table(f"{out}/pairs.parquet", TargetsPairRow)
    recon = [r for r in rows if r.split == "recon"]
    assert len(recon) == len(spans) and all(r.task == "recon" for r in recon)
    g, header = open_targets(f"{out}/targets.zarr")
    assert header.split_pairs["recon"] == len(spans)
    assert (g["pair_split"][:] == SPLIT_CODES["recon"]).sum() == len(spans)
    data = TargetsData(f"{out}/targets.zarr")
    tokens = data.tokens("recon")
    assert len(tokens) == sum(r.length for r in recon) and np.isfinite(data.rows(tokens[:8]).alpha.numpy()).all()
    assert "recon" not in split_pools(rows)  # training queries, never a held-out split


def test_the_default_reconstructs_the_whole_document_and_withholding_is_opt_in():
    # A product state reconstructs every unit (as KVzip); withheld_fraction > 0 leaves held-out blocks
    # out so `nectar compare` can report probes_withheld; at 0 that split is absent, not empty.
    probes = ProbesConfig(block_units=1)
    n_units = len(split_units(DOC))
    covered = {u for s in make_recon(DOC, ReconConfig(span_words=12), probes)
               for u in range(s.first_unit, s.last_unit + 1)}
    assert covered == set(range(n_units))
    assert withheld_units(n_units, ReconConfig(), probes) == set()
    held = withheld_units(n_units, ReconConfig(withheld_fraction=0.3), probes)
    partial = {u for s in make_recon(DOC, ReconConfig(span_words=12, withheld_fraction=0.3), probes)
               for u in range(s.first_unit, s.last_unit + 1)}
    assert held and not held & partial and held | partial == set(range(n_units))
    sel = Selection([], {}, {"probes": ["a", "b"]})
    assert with_subset(sel, "probes", "probes_withheld", set(), EvaluateConfig()) is sel


def test_withheld_probes_lie_wholly_in_the_withheld_units():
    # probes_withheld: the held-out probes lying wholly in the units reconstruction leaves out (none at
    # the default); on a real document (the default one) with the probes' default blocks
    text, _ = load_document("pydoc:naming")
    probes, recon = ProbesConfig(), ReconConfig(withheld_fraction=0.1)
    rows = make_probes(text, probes)
    held = withheld_units(len(split_units(text)), recon, probes)
    ids = withheld_probes(text, recon, probes, rows)
    assert ids and withheld_probes(text, ReconConfig(), probes, rows) == set()
    assert ids == {p.probe_id for p in rows if p.split == "probes"
                   and set(range(p.first_unit, p.last_unit + 1)) <= held}


def test_further_passes_retile_the_document_and_pass_one_is_unchanged():
    # passes=1 is the reconstruction before passes existed (ids, spans); each further pass covers every
    # unit again with other boundaries, and the setting stays out of cache keys at its default.
    probes = ProbesConfig(block_units=1)
    one = make_recon(DOC, ReconConfig(span_words=40), probes)
    three = make_recon(DOC, ReconConfig(span_words=40, passes=3), probes)
    assert three[:len(one)] == one and [s.span_id for s in one] == [f"recon-{i:05d}" for i in range(len(one))]
    assert len({s.span_id for s in three}) == len(three)
    n_units = len(split_units(DOC))
    bounds = []
    for p in (1, 2):
        spans = [s for s in three if s.span_id.startswith(f"recon-p{p:03d}-")]
        assert {u for s in spans for u in range(s.first_unit, s.last_unit + 1)} == set(range(n_units))
        assert all(s.response in DOC for s in spans)
        bounds.append([s.first_unit for s in spans])
    assert [s.first_unit for s in one] not in bounds  # the later passes cut the document elsewhere
    assert "passes" not in ReconConfig().cache_dict() and ReconConfig(passes=2).cache_dict()["passes"] == 2
    assert make_recon(DOC, ReconConfig(span_words=40, passes=3), probes) == three  # deterministic
