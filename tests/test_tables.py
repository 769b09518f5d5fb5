"""nectar.tables: parquet tables of pydantic rows and JSON artifacts, validated on write and on read."""
from __future__ import annotations

import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nectar.schemas.artifacts import ChunkRow, DatasetRow, ModuleSpec, PairRow, StageManifest, TrainLogRow
from nectar.schemas.base import Artifact
from nectar.tables import (
    ArtifactError, arrow_schema, read_json_artifact, read_table, write_json_artifact, write_table,
)


def chunks(n: int = 3) -> list[ChunkRow]:
    return [ChunkRow(chunk_id=i, start_word=10 * i, end_word=10 * i + 12, n_words=12, text=f"chunk {i} ünïcode")
            for i in range(n)]


def dataset_rows() -> list[DatasetRow]:
    common = dict(chunk_id=0, task="qa", instruction="Who?", response="Ilse", full_answer="Ilse Brandt",
                  judge_raw="{}", reasoning="")
    return [
        DatasetRow(pair_id="a", is_consistent=True, confidence=0.9, verdict="consistent", kept=True, split="train",
                   max_train_similarity=None, **common),
        DatasetRow(pair_id="b", is_consistent=None, confidence=None, verdict="judge_parse_error", kept=False,
                   split="dropped", **common),
        DatasetRow(pair_id="c", is_consistent=False, confidence=0.2, verdict="inconsistent", kept=True,
                   kept_by_floor=True, split="test", challenge=True, max_train_similarity=0.5, **common),
    ]


def spec() -> ModuleSpec:
    return ModuleSpec(
        base_model="tiny:llama", base_model_hash="h", doc_sha256="d", n_context=10, num_layers=2, num_kv_heads=2,
        num_q_heads=4, head_dim=16, scaling=0.25, arch="mlp", module_config={"rho": 0.25, "depths": [0, 2, 2]},
        rho=0.25, per_layer_params=[10, 20], n_params=60, module_bytes=240, kv_cache_bytes=5120,
        normalization={"A": {"mean": [0.5, -1.0]}, "ok": True},
    )


# --- round trips -------------------------------------------------------------------------------


def test_round_trip_of_simple_rows(tmp_path):
    url = str(tmp_path / "chunk" / "chunks.parquet")  # parent dirs are created
    rows = chunks()
    assert write_table(url, rows, ChunkRow) == 3
    assert read_table(url, ChunkRow) == rows
    assert not (tmp_path / "chunk" / "chunks.parquet.tmp").exists()  # temp file renamed away


def test_round_trip_keeps_nulls_bools_floats_and_order(tmp_path):
    url = str(tmp_path / "dataset.parquet")
    rows = dataset_rows()
    write_table(url, rows, DatasetRow)
    back = read_table(url, DatasetRow)
    assert back == rows
    assert [r.pair_id for r in back] == ["a", "b", "c"]
    assert back[1].is_consistent is None and back[1].confidence is None
    assert back[2].kept_by_floor is True and back[2].max_train_similarity == 0.5


def test_dict_and_list_fields_are_stored_as_json_and_come_back_nested(tmp_path):
    url = str(tmp_path / "spec.parquet")
    write_table(url, [spec()], ModuleSpec)
    raw = pq.read_table(url)
    assert raw.schema.field("module_config").type == pa.string()
    assert raw.column("per_layer_params").to_pylist() == ["[10, 20]"]
    back = read_table(url, ModuleSpec)
    assert back == [spec()]
    assert back[0].normalization == {"A": {"mean": [0.5, -1.0]}, "ok": True}


def test_plain_dicts_are_validated_into_rows(tmp_path):
    url = str(tmp_path / "c.parquet")
    write_table(url, [r.model_dump() for r in chunks(2)], ChunkRow)
    assert read_table(url, ChunkRow) == chunks(2)


def test_generators_and_empty_tables(tmp_path):
    url = str(tmp_path / "gen.parquet")
    assert write_table(url, (r for r in chunks(4)), ChunkRow) == 4
    assert len(read_table(url, ChunkRow)) == 4
    empty = str(tmp_path / "empty.parquet")
    assert write_table(empty, [], ChunkRow) == 0
    assert read_table(empty, ChunkRow) == []
    assert pq.read_schema(empty).names == list(ChunkRow.model_fields)  # the schema is there without rows


def test_rewriting_a_table_replaces_it(tmp_path):
    url = str(tmp_path / "c.parquet")
    write_table(url, chunks(5), ChunkRow)
    write_table(url, chunks(2), ChunkRow)
    assert read_table(url, ChunkRow) == chunks(2)


def test_fsspec_memory_urls_work():
    url = f"memory://tables-{uuid.uuid4().hex}/stage/rows.parquet"
    write_table(url, chunks(), ChunkRow)
    assert read_table(url, ChunkRow) == chunks()


# --- the parquet schema ------------------------------------------------------------------------


def test_arrow_schema_types_and_metadata():
    schema = arrow_schema(DatasetRow)
    assert schema.names == list(DatasetRow.model_fields)
    types = {f.name: f.type for f in schema}
    assert types["chunk_id"] == pa.int64()
    assert types["confidence"] == pa.float64()  # float | None → nullable float
    assert types["is_consistent"] == pa.bool_()
    assert types["verdict"] == pa.string()  # Literal
    assert types["task"] == pa.string()
    assert schema.metadata == {b"nectar.schema": b"DatasetRow", b"nectar.version": b"1"}


def test_written_file_carries_schema_name_and_version(tmp_path):
    url = str(tmp_path / "log.parquet")
    write_table(url, [TrainLogRow(step=1, samples=2, split="train", lr=1e-3, loss=1.0, loss_alpha=0.1,
                                  loss_A=0.5, loss_kl=0.0)], TrainLogRow)
    meta = pq.read_schema(url).metadata
    assert meta[b"nectar.schema"] == b"TrainLogRow" and meta[b"nectar.version"] == b"1"
    assert pq.read_schema(url).field("step").type == pa.int64()


# --- validation on write -----------------------------------------------------------------------


def test_invalid_row_on_write_names_file_row_and_field(tmp_path):
    url = str(tmp_path / "bad.parquet")
    rows = [r.model_dump() for r in chunks(3)]
    rows[2]["n_words"] = "twelve"
    with pytest.raises(ArtifactError) as info:
        write_table(url, rows, ChunkRow)
    msg = str(info.value)
    assert msg.startswith(f"{url}: row 2: field 'n_words':")
    assert "integer" in msg
    assert not (tmp_path / "bad.parquet").exists() and not (tmp_path / "bad.parquet.tmp").exists()


def test_missing_and_extra_fields_on_write(tmp_path):
    url = str(tmp_path / "bad.parquet")
    row = chunks(1)[0].model_dump()
    with pytest.raises(ArtifactError, match=r"row 0: field 'text': Field required"):
        write_table(url, [{k: v for k, v in row.items() if k != "text"}], ChunkRow)
    with pytest.raises(ArtifactError, match=r"row 0: field 'colour': Extra inputs are not permitted"):
        write_table(url, [{**row, "colour": "red"}], ChunkRow)
    with pytest.raises(ArtifactError, match=r"row 0: field 'task'"):
        write_table(url, [PairRow(pair_id="p", chunk_id=0, task="qa", instruction="i", response="r",
                                  raw_output="").model_dump() | {"task": "poetry"}], PairRow)


def test_a_row_of_another_schema_is_rejected_on_write(tmp_path):
    with pytest.raises(ArtifactError, match=r"row 0: field '<row>'"):
        write_table(str(tmp_path / "x.parquet"), chunks(1), PairRow)


# --- validation on read ------------------------------------------------------------------------


def _raw_chunk_table(path, columns: dict, meta: dict | None = None) -> None:
    table = pa.table(columns)
    if meta is not None:
        table = table.replace_schema_metadata(meta)
    pq.write_table(table, path)


CHUNK_META = {b"nectar.schema": b"ChunkRow", b"nectar.version": b"1"}
GOOD = {"schema_version": [1], "chunk_id": [0], "start_word": [0], "end_word": [3], "n_words": [3], "text": ["a b c"]}


def test_hand_written_table_that_matches_reads_fine(tmp_path):
    path = tmp_path / "ok.parquet"
    _raw_chunk_table(path, GOOD, CHUNK_META)
    assert read_table(str(path), ChunkRow) == [ChunkRow(chunk_id=0, start_word=0, end_word=3, n_words=3, text="a b c")]


def test_missing_column_on_read_names_file_and_field(tmp_path):
    path = tmp_path / "renamed.parquet"
    cols = {("words" if k == "n_words" else k): v for k, v in GOOD.items()}
    _raw_chunk_table(path, cols, CHUNK_META)
    with pytest.raises(ArtifactError) as info:
        read_table(str(path), ChunkRow)
    assert str(info.value) == f"{path}: row 0: field 'n_words': Field required"


def test_wrongly_typed_column_on_read_names_file_row_and_field(tmp_path):
    path = tmp_path / "typed.parquet"
    _raw_chunk_table(path, {**GOOD, "end_word": ["three"]}, CHUNK_META)
    with pytest.raises(ArtifactError, match=rf"{path}: row 0: field 'end_word':"):
        read_table(str(path), ChunkRow)


def test_extra_column_on_read_is_rejected(tmp_path):
    path = tmp_path / "extra.parquet"
    _raw_chunk_table(path, {**GOOD, "score": [0.5]}, CHUNK_META)
    with pytest.raises(ArtifactError, match=r"field 'score': Extra inputs are not permitted"):
        read_table(str(path), ChunkRow)


def test_bad_row_is_reported_by_index(tmp_path):
    path = tmp_path / "third.parquet"
    cols = {k: v * 3 for k, v in GOOD.items()}
    cols["text"] = ["a", "b", None]
    _raw_chunk_table(path, cols, CHUNK_META)
    with pytest.raises(ArtifactError, match=r"row 2: field 'text'"):
        read_table(str(path), ChunkRow)


def test_table_without_nectar_metadata_is_refused(tmp_path):
    path = tmp_path / "foreign.parquet"
    _raw_chunk_table(path, GOOD)
    with pytest.raises(ArtifactError, match=rf"{path}: holds an unknown schema, expected ChunkRow"):
        read_table(str(path), ChunkRow)


def test_table_of_another_schema_is_refused(tmp_path):
    url = str(tmp_path / "chunks.parquet")
    write_table(url, chunks(), ChunkRow)
    with pytest.raises(ArtifactError, match=r"holds ChunkRow, expected PairRow"):
        read_table(url, PairRow)


def test_table_of_another_schema_version_is_refused(tmp_path):
    path = tmp_path / "v2.parquet"
    _raw_chunk_table(path, GOOD, {**CHUNK_META, b"nectar.version": b"2"})
    with pytest.raises(ArtifactError, match=r"schema version 2, this release reads 1"):
        read_table(str(path), ChunkRow)


def test_missing_table_says_which_schema_was_expected(tmp_path):
    url = str(tmp_path / "synthesize" / "pairs.parquet")
    expected = r"pairs.parquet: missing \(expected a PairRow table; has its stage run\?\)"
    with pytest.raises(ArtifactError, match=expected):
        read_table(url, PairRow)


def test_artifact_error_is_a_value_error():
    assert issubclass(ArtifactError, ValueError)


class _OptionalList(Artifact):
    name: str
    values: list[int] | None = None


def test_optional_list_fields_round_trip(tmp_path):
    url = str(tmp_path / "opt.parquet")
    rows = [_OptionalList(name="a", values=[1, 2]), _OptionalList(name="b")]
    write_table(url, rows, _OptionalList)
    assert read_table(url, _OptionalList) == rows


# --- JSON artifacts ----------------------------------------------------------------------------


def manifest() -> StageManifest:
    return StageManifest(stage="chunk", cache_key="k" * 64, config={"chunk": {"words": 60}}, inputs={"doc": "h"},
                         outputs={"chunks.parquet": "abc"}, code_version="0.1.0", counts={"chunks": 3},
                         started_at="2024-01-01T00:00:00+00:00", finished_at="2024-01-01T00:00:01+00:00",
                         duration_s=1.0)


def test_json_artifact_round_trip_is_atomic(tmp_path):
    url = str(tmp_path / "chunk" / "manifest.json")
    write_json_artifact(url, manifest())
    assert read_json_artifact(url, StageManifest) == manifest()
    assert sorted(p.name for p in (tmp_path / "chunk").iterdir()) == ["manifest.json"]


def test_missing_json_artifact(tmp_path):
    with pytest.raises(ArtifactError, match=r"manifest.json: missing \(expected StageManifest\)"):
        read_json_artifact(str(tmp_path / "manifest.json"), StageManifest)


def test_invalid_json_artifact_names_file_and_field(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text(manifest().model_dump_json().replace('"duration_s":1.0', '"duration_s":"slow"'))
    with pytest.raises(ArtifactError, match=rf"{path}: field 'duration_s':"):
        read_json_artifact(str(path), StageManifest)
    path.write_text("{not json")
    with pytest.raises(ArtifactError, match=rf"{path}: field '<root>':"):
        read_json_artifact(str(path), StageManifest)
