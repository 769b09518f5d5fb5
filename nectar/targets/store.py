"""The targets Zarr v3 group: token-major arrays, chunked for batch reads, sharded for writes.

Layout and header: see ``TargetsHeader`` in nectar/schemas/artifacts.py. bf16 has no zarr dtype, so
values are stored as float32 (default) or float16 and read back as float32.
"""
from __future__ import annotations

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec
from pydantic import ValidationError

from ..schemas.artifacts import TargetsHeader
from ..tables import ArtifactError

HEADER_KEY = "nectar_targets"
CHECKED = (Crc32cCodec(),)  # the last codec of every array: a checksum per chunk


def open_store(url: str):
    if "://" in url and not url.startswith("file://"):
        from zarr.storage import FsspecStore

        return FsspecStore.from_url(url)
    return zarr.storage.LocalStore(url.removeprefix("file://"))


def create_targets(url: str, header: TargetsHeader, chunk_tokens: int, shard_tokens: int) -> zarr.Group:
    """Create (overwrite) the group with every array sized for ``header.n_tokens``."""
    T, L, H, d, K = header.n_tokens, header.num_layers, header.num_q_heads, header.head_dim, header.top_k
    P = header.n_pairs
    shard = max(chunk_tokens, (shard_tokens // chunk_tokens) * chunk_tokens)
    g = zarr.open_group(open_store(url), mode="w", zarr_format=3)
    vdt = header.dtype

    def arr(name, shape, dtype, tail_chunks):
        # Float targets are near-incompressible (zstd saved 7%) yet compressing them took a third
        # of the stage's time on CPU, so they are stored raw; integer/bool arrays keep zstd.
        raw = np.dtype(dtype).kind == "f"
        # Every chunk is written once, whole: skip zarr's scan of each chunk for all-fill values.
        # A crc32c per chunk: reading a damaged chunk raises instead of returning wrong numbers.
        g.create_array(name, shape=shape, dtype=dtype, chunks=(chunk_tokens, *tail_chunks),
                       shards=(shard, *tail_chunks), fill_value=0,
                       compressors=CHECKED if raw else (ZstdCodec(level=0), *CHECKED),
                       config={"write_empty_chunks": True})

    arr("q", (T, L, H, d), vdt, (L, H, d))
    arr("A", (T, L, H, d), vdt, (L, H, d))
    arr("alpha", (T, L, H), vdt, (L, H))
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


def read_tokens(g: zarr.Group, start: int, stop: int, names=("q", "alpha", "A")) -> dict[str, np.ndarray]:
    """Rows [start, stop) of the named arrays, values as float32."""
    out = {}
    for name in names:
        a = g[name][start:stop]
        out[name] = a.astype(np.float32) if a.dtype == np.float16 else a
    return out
