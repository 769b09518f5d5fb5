"""Base classes shared by every config and artifact.

Configs are frozen (hashable, safe to pass around) and reject unknown keys so a typo in a YAML
file is an error, not a silently ignored setting. Artifacts carry a schema version so a reader can
refuse files written by an incompatible release.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field


class FrozenConfig(BaseModel):
    """A stage or pipeline configuration. Fields marked ``resource=True`` don't enter cache keys."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    def __hash__(self) -> int:
        # pydantic's frozen hash hashes field values and fails on dict fields (synthesize.counts);
        # the canonical JSON of every field is consistent with ``==``.
        return hash(json.dumps(self.model_dump(mode="json"), sort_keys=True))

    def cache_dict(self) -> dict[str, Any]:
        """The config as plain data minus resource-only fields (device, batch sizes, concurrency)."""
        out: dict[str, Any] = {}
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            if extra.get("resource"):
                continue
            value = getattr(self, name)
            if extra.get("omit_default") and value == field.default:
                continue  # a setting added later: at its default, runs made before it keep their ids
            out[name] = value.cache_dict() if isinstance(value, FrozenConfig) else _plain(value)
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def added_setting(default: Any, **kwargs: Any) -> Any:
    """A field added after runs were made: left out of cache keys and run ids while at its default, so
    those runs and their cached stages stay valid (set to anything else, it is part of them)."""
    return Field(default, json_schema_extra={"omit_default": True}, **kwargs)


def resource(default: Any, **kwargs: Any) -> Any:
    """A field that changes how fast or where a stage runs, never what it produces."""
    return Field(default, json_schema_extra={"resource": True}, **kwargs)


class Artifact(BaseModel):
    """A validated record passed between stages (a table row, a header, a manifest)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    SCHEMA_VERSION: ClassVar[int] = 1
    READS_VERSIONS: ClassVar[tuple[int, ...]] = (1,)  # versions of its files this release reads


def stable_hash(data: Any) -> str:
    """sha256 of canonical JSON: the same data always hashes the same across processes."""
    blob = json.dumps(_plain(data), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
