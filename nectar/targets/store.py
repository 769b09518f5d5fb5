"""The targets Zarr v3 group: token-major arrays, chunked for batch reads, sharded for writes.

Layout and header: see ``TargetsHeader`` in nectar/schemas/artifacts.py. q and A are stored as
float32 (default), float16, or bfloat16 — which zarr lacks, so as a uint16 view of the bf16 bits
with the array attribute ``nectar_view: bfloat16`` — and read back as float32 (``decode_values``).
α stays float32: it is the log of the document's attention mass, and bf16's 8-bit mantissa would
round a typical α of 20–40 by up to 0.125, a 13 % error in the merge weight.
"""
from __future__ import annotations

from pathlib import Path

import fsspec
import numpy as np
import torch
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec
from pydantic import ValidationError

from .. import integrity
from ..schemas.artifacts import TargetsHeader
from ..tables import ArtifactError

STORE_NAME = "targets.zarr"  # the group's folder inside the targets stage's output
HEADER_KEY = "nectar_targets"
VALUE_ARRAYS = ("q", "alpha", "A")  # the per-(layer, head) targets; absent from "online" groups
VIEW_KEY = "nectar_view"  # array attribute: the real dtype of a uint16 view
# Storage dtype of q and A per TargetsConfig.dtype (zarr has no bf16: its bits as uint16).
STORAGE_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}


def value_storage(name: str, dtype: str) -> str:
    """The zarr dtype array ``name`` is stored in for a group of header dtype ``dtype``."""
    return "float32" if name == "alpha" else STORAGE_DTYPES[dtype]


def encode_values(x: torch.Tensor, dtype: str) -> np.ndarray:
    """float tensor → host array in the storage dtype (converted on x's device: half the copy)."""
    if dtype == "bfloat16":
        return x.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
    return x.to(getattr(torch, dtype)).cpu().numpy()


def decode_values(a: np.ndarray, view: str | None = None) -> np.ndarray:
    """A stored block → float32 (a bf16 view is widened bit-exactly: bf16 is float32's top half)."""
    if view == "bfloat16":
        return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(a, dtype=np.float32)


def array_view(g: zarr.Group, name: str) -> str | None:
    return g[name].attrs.get(VIEW_KEY)

CHECKED = (Crc32cCodec(),)  # the last codec of every array: a checksum per chunk


def targets_zarr_url(url: str) -> str:
    """The group's URL from the targets stage folder or the group itself."""
    url = url.rstrip("/")
    return url if url.endswith(".zarr") else f"{url}/{STORE_NAME}"


def local_path(url: str) -> str | None:
    """The folder of a local group's URL (a path or file://), None for a remote store."""
    return None if "://" in url and not url.startswith("file://") else url.removeprefix("file://")


def open_store(url: str):
    path = local_path(url)
    if path is None:
        from zarr.storage import FsspecStore

        return FsspecStore.from_url(url)
    return zarr.storage.LocalStore(path)


def create_targets(url: str, header: TargetsHeader, chunk_tokens: int, shard_tokens: int) -> zarr.Group:
    """Create (overwrite) the group with every array sized for ``header.n_tokens``."""
    T, L, H, d, K = header.n_tokens, header.num_layers, header.num_q_heads, header.head_dim, header.top_k
    P = header.n_pairs
    shard = max(chunk_tokens, (shard_tokens // chunk_tokens) * chunk_tokens)
    g = zarr.open_group(open_store(url), mode="w", zarr_format=3)
    vdt = header.dtype

    def arr(name, shape, dtype, tail_chunks):
        # Float targets are near-incompressible (zstd saved 7%) yet compressing them took a third
        # of the stage's time on CPU, so they are stored raw (bf16 bits too); integer/bool arrays keep zstd.
        raw = np.dtype(dtype).kind == "f" or name in VALUE_ARRAYS
        # Every chunk is written once, whole: skip zarr's scan of each chunk for all-fill values.
        # A crc32c per chunk: reading a damaged chunk raises instead of returning wrong numbers.
        g.create_array(name, shape=shape, dtype=dtype, chunks=(chunk_tokens, *tail_chunks),
                       shards=(shard, *tail_chunks), fill_value=0,
                       compressors=CHECKED if raw else (ZstdCodec(level=0), *CHECKED),
                       config={"write_empty_chunks": True})

    if header.mode == "cached":
        arr("q", (T, L, H, d), value_storage("q", vdt), (L, H, d))
        arr("A", (T, L, H, d), value_storage("A", vdt), (L, H, d))
        arr("alpha", (T, L, H), value_storage("alpha", vdt), (L, H))
        if vdt == "bfloat16":
            for name in ("q", "A"):
                g[name].attrs[VIEW_KEY] = "bfloat16"
    arr("topk_ids", (T, K), "int32", (K,))
    arr("topk_logprobs", (T, K), "float32", (K,))
    arr("token_ids", (T,), "int32", ())
    arr("positions", (T,), "int32", ())
    arr("response_mask", (T,), "bool", ())
    g.create_array("pair_offsets", shape=(P + 1,), dtype="int64", chunks=(max(P + 1, 1),),
                   compressors=(ZstdCodec(level=0), *CHECKED))
    g.create_array("pair_split", shape=(max(P, 1),), dtype="int8", chunks=(max(P, 1),),
                   compressors=(ZstdCodec(level=0), *CHECKED))
    g.attrs[HEADER_KEY] = header.model_dump(mode="json")
    g.attrs["written_tokens"] = 0
    return g


PARTIAL_SUFFIX = ".partial"  # zarr's LocalStore writes NAME.<uuid>.partial, then renames it to NAME


def drop_unfinished_writes(url: str) -> int:
    """Delete the temporary files of writes a killed process never finished (a local group only:
    zarr's LocalStore writes each file beside its name and renames it; other stores write whole
    objects). Left in place they would stay in the group's files and its digest, so a resumed
    group would not match the uninterrupted one byte for byte. Returns how many were removed."""
    path = local_path(url)
    if path is None:
        return 0
    stale = [f for f in Path(path).rglob(f"*{PARTIAL_SUFFIX}") if f.is_file()]
    for f in stale:
        f.unlink(missing_ok=True)
    return len(stale)


def open_targets(url: str, mode: str = "r") -> tuple[zarr.Group, TargetsHeader]:
    try:
        g = zarr.open_group(open_store(url), mode=mode, zarr_format=3)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError) as exc:  # type: ignore[attr-defined]
        raise ArtifactError(f"{url}: no targets group ({exc}); has the targets stage run?") from None
    raw = g.attrs.get(HEADER_KEY)
    if raw is None:
        raise ArtifactError(f"{url}: targets group has no '{HEADER_KEY}' header attribute")
    try:
        header = TargetsHeader.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ArtifactError(f"{url}: header field {'.'.join(map(str, err['loc']))!r}: {err['msg']}") from None
    return g, header


def read_tokens(g: zarr.Group, start: int, stop: int, names=VALUE_ARRAYS) -> dict[str, np.ndarray]:
    """Rows [start, stop) of the named arrays, values as float32."""
    return {name: decode_values(g[name][start:stop], array_view(g, name)) for name in names}


def repair_shards(stage_url: str, changes: list[integrity.Change]) -> list[integrity.Change]:
    """The targets stage's repair (``run_stage``'s ``repair``): redo only the damaged shards of the
    group: delete them and move its ``written_tokens`` back to the first damaged shard, so the
    stage resumes from there. Anything else (its metadata, other files) is left to the default:
    removed and rebuilt. Returns the changes it did not repair."""
    zarr_changes = [c for c in changes if c.path.startswith(f"{STORE_NAME}/")]
    if not zarr_changes or any(c.path.endswith("zarr.json") for c in zarr_changes):
        return changes
    zurl = targets_zarr_url(stage_url)
    try:
        g = zarr.open_group(open_store(zurl), mode="r+", zarr_format=3)
        starts = []
        for c in zarr_changes:
            name, _, rest = c.path[len(STORE_NAME) + 1:].partition("/")
            if g[name].shards is None:  # pair_offsets / pair_split: rewritten whole at the end
                continue
            index = int(rest.split("/")[1])  # "<array>/c/<i>/0/..." (zarr v3 default chunk keys)
            starts.append(index * g[name].shards[0])
        written = int(g.attrs["written_tokens"])
    except Exception:  # a layout this doesn't know: rebuild the whole group
        return changes
    fs, base = fsspec.core.url_to_fs(zurl)
    for c in zarr_changes:
        shard = f"{base}/{c.path[len(STORE_NAME) + 1:]}"
        if fs.exists(shard):
            fs.rm(shard)
    g.attrs["written_tokens"] = min(written, *starts)
    return [c for c in changes if c not in zarr_changes]
