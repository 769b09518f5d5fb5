"""Parquet tables of pydantic rows, validated on write and on read.

A table carries its row schema's name and version in the parquet metadata; reading a table written
for another schema, or a row that doesn't validate, raises ArtifactError naming file, row and field.
"""
from __future__ import annotations

import json
import types
import typing
from typing import Any, Iterable, Literal, Sequence, TypeVar, get_args, get_origin

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from .schemas.base import Artifact
from .storage import atomic_write

R = TypeVar("R", bound=Artifact)


class ArtifactError(ValueError):
    """An artifact on disk is missing or doesn't match its schema."""


def _arrow_type(annotation: Any) -> pa.DataType:
    origin = get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        return _arrow_type(inner[0])
    if origin is Literal:
        return pa.string()
    if annotation is bool:
        return pa.bool_()
    if annotation is int:
        return pa.int64()
    if annotation is float:
        return pa.float64()
    if annotation is str:
        return pa.string()
    return pa.string()  # dicts, lists: stored as JSON text



def arrow_schema(cls: type[Artifact]) -> pa.Schema:
    fields = [pa.field(name, _arrow_type(f.annotation)) for name, f in cls.model_fields.items()]
    meta = {b"nectar.schema": cls.__name__.encode(), b"nectar.version": str(cls.SCHEMA_VERSION).encode()}
    return pa.schema(fields, metadata=meta)


def _json_fields(cls: type[Artifact]) -> set[str]:
    """Fields stored as JSON text: dicts and lists, optional or not (as ``_arrow_type`` maps them)."""
    return {n for n, f in cls.model_fields.items() if _is_container(f.annotation)}


def _is_container(annotation: Any) -> bool:
    origin = get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_is_container(a) for a in get_args(annotation) if a is not type(None))
    return origin in (dict, list) or annotation in (dict, list)


def write_table(url: str, rows: Iterable[Artifact], cls: type[R]) -> int:
    """Validate ``rows`` as ``cls`` and write them to ``url`` (local path or fsspec URL)."""
    records = []
    jf = _json_fields(cls)
    for i, row in enumerate(rows):
        if not isinstance(row, cls):
            try:
                row = cls.model_validate(row)
            except ValidationError as exc:
                raise ArtifactError(_describe(url, i, exc)) from None
        rec = row.model_dump(mode="json")
        for name in jf:
            rec[name] = None if rec[name] is None else json.dumps(rec[name])
        records.append(rec)
    table = pa.Table.from_pylist(records, schema=arrow_schema(cls))
    atomic_write(url, lambda f: pq.write_table(table, f))  # readers never see a half-written table
    return len(records)


def read_table(url: str, cls: type[R]) -> list[R]:
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
        raise ArtifactError(f"{url}: missing (expected a {cls.__name__} table; has its stage run?)")
    try:
        with fs.open(path, "rb") as f:
            table = pq.read_table(f)
    except (pa.ArrowException, OSError) as exc:  # truncated, overwritten, not parquet at all
        reason = " ".join(str(exc).split())[:200]
        raise ArtifactError(f"{url}: not a readable {cls.__name__} table ({type(exc).__name__}: {reason})") from None
    meta = table.schema.metadata or {}
    name = meta.get(b"nectar.schema", b"").decode()
    if name != cls.__name__:
        raise ArtifactError(f"{url}: holds {name or 'an unknown schema'}, expected {cls.__name__}")
    version = int(meta.get(b"nectar.version", b"0"))
    if version not in cls.READS_VERSIONS:
        raise ArtifactError(f"{url}: schema version {version}, this release reads "
                            f"{' and '.join(map(str, cls.READS_VERSIONS))}")
    jf = _json_fields(cls)
    out = []
    for i, rec in enumerate(table.to_pylist()):
        for key in jf:
            if isinstance(rec.get(key), str):
                rec[key] = json.loads(rec[key])
        try:
            out.append(cls.model_validate(rec))
        except ValidationError as exc:
            raise ArtifactError(_describe(url, i, exc)) from None
    return out


def _describe(url: str, row: int, exc: ValidationError) -> str:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or "<row>"
    return f"{url}: row {row}: field {field!r}: {err['msg']}"


def read_json_artifact(url: str, cls: type[R]) -> R:
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
        raise ArtifactError(f"{url}: missing (expected {cls.__name__})")
    with fs.open(path, "r") as f:
        text = f.read()
    try:
        return cls.model_validate_json(text)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "<root>"
        raise ArtifactError(f"{url}: field {field!r}: {err['msg']}") from None


def write_json_artifact(url: str, obj: Artifact) -> None:
    """Atomic JSON write (temp file + rename)."""
    atomic_write(url, obj.model_dump_json(indent=2))


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table of formatted cells (each written as ``str(cell)``), ending in a newline."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in cells) + " |" for cells in rows]
    return "\n".join(lines) + "\n"
