"""Artifact schemas: unknown fields rejected, required fields enforced, literals checked, round trips."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from nectar.schemas import artifacts as A
from nectar.schemas.base import Artifact
from nectar.tables import ArtifactError


def header(**over) -> A.TargetsHeader:
    data = dict(
        model="tiny:llama", model_hash="0123abcd", doc_sha256="f" * 64, n_context=298, num_layers=2,
        num_q_heads=4, num_kv_heads=2, head_dim=16, scaling=0.25, top_k=8, dtype="float32", n_pairs=3,
        n_tokens=41, split_pairs={"train": 2, "test": 1},
    )
    data.update(over)
    return A.TargetsHeader(**data)


def _errors(exc: ValidationError) -> dict[str, str]:
    return {".".join(str(p) for p in e["loc"]): e["type"] for e in exc.errors()}


def test_every_exported_artifact_is_an_artifact_with_a_schema_version():
    for name in A.__all__:
        obj = getattr(A, name)
        if isinstance(obj, type):
            assert issubclass(obj, Artifact), name
            version = 2 if issubclass(obj, A.QualityColumns) else 1  # metrics and comparison rows: v2
            assert obj.SCHEMA_VERSION == version and obj.READS_VERSIONS[-1] == version
            assert obj.model_fields["schema_version"].default == version


@pytest.mark.parametrize("cls, extra", [
    (A.MetricsRow, {"model": "module", "token_acc": 0.5, "cross_entropy": 1.2, "kl_to_full": 0.01}),
    (A.ComparisonRow, {"system": "evict", "kind": "baseline", "state_bytes": 64, "n_pairs": 3, "kl_to_full": 0.02}),
])
def test_version_1_metrics_and_comparison_tables_still_read(tmp_path, cls, extra):
    """Version 1 wrote these rows' columns in another order (before they shared QualityColumns)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nectar.tables import read_table, write_table

    row = cls(split="test", n_tokens=31, recovered_kl=0.9, recovered_kl_ci_low=0.8, recovered_kl_ci_high=0.95,
              **extra)
    v2 = tmp_path / "v2.parquet"
    write_table(str(v2), [row], cls)
    table = pq.read_table(v2)
    old = table.select(table.column_names[::-1])  # another column order: read by name
    old = old.set_column(old.schema.get_field_index("schema_version"), "schema_version", pa.array([1], pa.int64()))
    old = old.replace_schema_metadata({b"nectar.schema": cls.__name__.encode(), b"nectar.version": b"1"})
    pq.write_table(old, tmp_path / "v1.parquet")
    (back,) = read_table(str(tmp_path / "v1.parquet"), cls)
    assert back.model_dump(exclude={"schema_version"}) == row.model_dump(exclude={"schema_version"})
    assert back.schema_version == 1 and row.schema_version == 2
    newer = old.replace_schema_metadata({b"nectar.schema": cls.__name__.encode(), b"nectar.version": b"3"})
    pq.write_table(newer, tmp_path / "v3.parquet")
    with pytest.raises(ArtifactError, match="schema version 3, this release reads 1 and 2"):
        read_table(str(tmp_path / "v3.parquet"), cls)


def test_targets_header_round_trips_through_dump_and_validate():
    h = header(complete=True)
    again = A.TargetsHeader.model_validate(h.model_dump())
    assert again == h
    # also through JSON text (what the zarr attributes hold)
    via_json = A.TargetsHeader.model_validate(json.loads(h.model_dump_json()))
    assert via_json == h and via_json.split_pairs == {"train": 2, "test": 1} and via_json.complete is True
    assert h != header(complete=False)


def test_targets_header_defaults():
    h = header()
    assert h.complete is False and h.schema_version == 1


def test_extra_fields_are_rejected():
    with pytest.raises(ValidationError) as info:
        header(n_ctx=5)
    assert _errors(info.value) == {"n_ctx": "extra_forbidden"}
    with pytest.raises(ValidationError) as info:
        A.ChunkRow.model_validate({"chunk_id": 0, "start_word": 0, "end_word": 1, "n_words": 1, "text": "a",
                                   "words": 1})
    assert _errors(info.value) == {"words": "extra_forbidden"}


def test_required_fields_are_reported_by_name():
    data = header().model_dump()
    del data["n_tokens"], data["model_hash"]
    with pytest.raises(ValidationError) as info:
        A.TargetsHeader.model_validate(data)
    assert _errors(info.value) == {"n_tokens": "missing", "model_hash": "missing"}
    with pytest.raises(ValidationError) as info:
        A.StageManifest(stage="chunk")
    missing = {k for k, v in _errors(info.value).items() if v == "missing"}
    assert missing == {"cache_key", "config", "inputs", "outputs", "code_version", "started_at",
                       "finished_at", "duration_s"}  # counts has a default


def test_literal_fields_reject_values_outside_the_schema():
    with pytest.raises(ValidationError, match="dtype"):
        header(dtype="int8")  # bfloat16 is stored as a uint16 view; int8 is no storage dtype
    with pytest.raises(ValidationError, match="task"):
        A.PairRow(pair_id="p", chunk_id=0, task="translation", instruction="i", response="r", raw_output="")
    with pytest.raises(ValidationError, match="split"):
        A.TargetsPairRow(index=0, pair_id="p", task="qa", split="dropped", challenge=False, start=0,
                         length=3, response_start=1, truncated=False)


def test_types_are_checked_not_silently_truncated():
    with pytest.raises(ValidationError, match="n_tokens"):
        header(n_tokens=4.5)
    with pytest.raises(ValidationError, match="split_pairs"):
        header(split_pairs={"train": "many"})


def test_optional_fields_and_defaults_of_a_dataset_row():
    row = A.DatasetRow(pair_id="p1", chunk_id=0, task="qa", instruction="q", response="r", full_answer="a",
                       judge_raw="{}", is_consistent=None, confidence=None, reasoning="", verdict="judge_parse_error",
                       kept=False, split="dropped")
    assert (row.kept_by_floor, row.challenge, row.max_train_similarity) == (False, False, None)
    assert A.DatasetRow.model_validate(row.model_dump()) == row
    with pytest.raises(ValidationError, match="verdict"):
        A.DatasetRow.model_validate({**row.model_dump(), "verdict": "maybe"})
    with pytest.raises(ValidationError, match="is_consistent"):  # Optional, but still required
        A.DatasetRow.model_validate({k: v for k, v in row.model_dump().items() if k != "is_consistent"})


def test_stage_manifest_counts_default_is_not_shared():
    kw = dict(stage="chunk", cache_key="k", config={}, inputs={}, outputs={}, code_version="0",
              started_at="t0", finished_at="t1", duration_s=0.1)
    a, b = A.StageManifest(**kw), A.StageManifest(**kw)
    a.counts["chunks"] = 3
    assert b.counts == {}


def test_module_spec_round_trips_nested_json():
    spec = A.ModuleSpec(
        base_model="tiny:llama", base_model_hash="h", doc_sha256="d", n_context=10, num_layers=2,
        num_kv_heads=2, num_q_heads=4, head_dim=16, scaling=0.25, arch="quadrature",
        module_config={"rho": 0.25, "depths": [0, 2, 2]}, rho=0.25, per_layer_params=[10, 20], n_params=60,
        module_bytes=240, kv_cache_bytes=5120, normalization={"A": {"mean": [0.0, 1.0]}},
    )
    assert A.ModuleSpec.model_validate_json(spec.model_dump_json()) == spec
    with pytest.raises(ValidationError, match="arch"):
        A.ModuleSpec.model_validate({**spec.model_dump(), "arch": "lora"})
