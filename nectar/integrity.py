"""Content digests of a stage's outputs: recorded when the stage completes, checked before it counts
as cached.

A stage's outputs are files or folders (the targets Zarr group) under its folder. The manifest keeps
one sha256 per FILE (every Zarr shard and metadata file separately), so a check names the file that
changed and a stage can redo only what is damaged, and one digest per declared OUTPUT — the file's
sha256, or for a folder ``tree:`` + the sha256 of its files' (path, digest) list — which downstream
cache keys use (lineage by content, not by names and sizes).

Checking re-reads every byte: a shard overwritten with zeros of the same size (and its old mtime
restored) is caught. A file this process already hashed and that is unchanged since (same inode,
size, mtime and ctime, which no user-level write can keep) is not read twice in one process.
"""
from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Mapping

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from .schemas.artifacts import FileDigest
from .storage import Written, canonical, file_mtime
from .tables import ArtifactError

# hashlib releases the GIL on large blocks, so a few threads overlap reads with hashing.
HASH_THREADS = min(4, os.cpu_count() or 1)
BLOCK = 1 << 22
TMP_SUFFIX = ".tmp"  # atomic_write's temp files: never content

_memo_lock = threading.Lock()
_MEMO: dict[str, tuple[tuple[int, int, int, int], str]] = {}


class MissingOutput(ArtifactError):
    """A stage declared an output that is not there."""


@dataclass(frozen=True)
class Change:
    """One way a stage's outputs differ from what its manifest recorded."""

    path: str  # relative to the stage folder, e.g. "targets.zarr/q/c/1/0/0/0"
    what: str  # "missing" | "changed" | "size" | "unexpected"
    detail: str = ""

    def describe(self, stage: str) -> str:
        text = {"missing": "is missing", "changed": "changed (sha256 differs)",
                "size": f"changed size ({self.detail})", "unexpected": "appeared (not written by the stage)",
                "unreadable": f"cannot be read ({self.detail})",
                "unrecorded": "records no file digests (written by an older release)"}[self.what]
        return f"{stage}/{self.path} {text}"


def _stat_key(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def hash_file(fs: fsspec.AbstractFileSystem, path: str) -> tuple[str, int]:
    """sha256 and size of one file, streamed."""
    local = isinstance(fs, LocalFileSystem)
    key = canonical(fs, path)
    if local:
        stat = _stat_key(path)
        with _memo_lock:
            hit = _MEMO.get(key)
        if stat is not None and hit is not None and hit[0] == stat:
            return hit[1], stat[1]
    h, size = hashlib.sha256(), 0
    with (open(path, "rb") if local else fs.open(path, "rb")) as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
            size += len(block)
    digest = h.hexdigest()
    if local and stat is not None and _stat_key(path) == stat:  # unchanged while we read it
        with _memo_lock:
            _MEMO[key] = (stat, digest)
    return digest, size


def list_output_files(fs: fsspec.AbstractFileSystem, stage_path: str, names: Iterable[str]) -> dict[str, str]:
    """Relative path → filesystem path of every file making up the named outputs."""
    stage_path = stage_path.rstrip("/")
    out: dict[str, str] = {}
    for name in names:
        path = f"{stage_path}/{name}"
        if not fs.exists(path):
            raise MissingOutput(f"{fs.unstrip_protocol(path)}: missing")
        if fs.isdir(path):
            for found in sorted(fs.find(path)):
                rel = found[len(stage_path) + 1:] if found.startswith(stage_path + "/") else None
                if rel is None:  # some filesystems return protocol-less or normalised paths
                    rel = f"{name}/{found.rsplit(name + '/', 1)[-1]}"
                if not rel.endswith(TMP_SUFFIX):
                    out[rel] = found
        else:
            out[name] = path
    return out


def digest_outputs(fs: fsspec.AbstractFileSystem, stage_path: str, names: Iterable[str],
                   written: Mapping[str, Written] | None = None) -> dict[str, FileDigest]:
    """The digest of every file of the named outputs: taken from ``written`` (what atomic_write
    hashed as it wrote) when the file is still as it was written, else read and hashed."""
    files = list_output_files(fs, stage_path, names)
    written = written or {}
    out: dict[str, FileDigest] = {}
    todo: list[str] = []
    for rel, path in files.items():
        rec = written.get(canonical(fs, path))
        if rec is not None and rec.mtime is not None:
            try:
                same = fs.size(path) == rec.size and file_mtime(fs, path) == rec.mtime
            except OSError:
                same = False
            if same:
                out[rel] = FileDigest(sha256=rec.sha256, size=rec.size)
                continue
        todo.append(rel)
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        for rel, (sha, size) in zip(todo, pool.map(lambda r: hash_file(fs, files[r]), todo)):
            out[rel] = FileDigest(sha256=sha, size=size)
    return dict(sorted(out.items()))


def output_digest(files: Mapping[str, FileDigest], name: str) -> str:
    """One content digest for a declared output: its sha256, or a tree digest for a folder."""
    if name in files:
        return files[name].sha256
    prefix = name.rstrip("/") + "/"
    h = hashlib.sha256()
    for rel in sorted(r for r in files if r.startswith(prefix)):
        h.update(f"{rel[len(prefix):]}\0{files[rel].sha256}\n".encode())
    return "tree:" + h.hexdigest()


def check_outputs(fs: fsspec.AbstractFileSystem, stage_path: str, recorded: Mapping[str, FileDigest],
                  names: Iterable[str]) -> list[Change]:
    """How the files on disk differ from ``recorded`` (empty: intact). Every byte is re-read."""
    stage_path = stage_path.rstrip("/")
    changes: list[Change] = []
    try:
        present = list_output_files(fs, stage_path, names)
    except MissingOutput:
        present = {}
        for name in names:
            try:
                present.update(list_output_files(fs, stage_path, [name]))
            except MissingOutput:
                pass
    for rel in present.keys() - recorded.keys():
        changes.append(Change(rel, "unexpected"))
    todo = []
    for rel, want in recorded.items():
        if rel not in present:
            changes.append(Change(rel, "missing"))
            continue
        try:
            size = fs.size(present[rel])
        except OSError as exc:
            changes.append(Change(rel, "unreadable", str(exc)))
            continue
        if size != want.size:
            changes.append(Change(rel, "size", f"{want.size} → {size} bytes"))
        else:
            todo.append(rel)

    def digest(rel: str) -> str | Exception:
        try:
            return hash_file(fs, present[rel])[0]
        except OSError as exc:
            return exc

    with ThreadPoolExecutor(HASH_THREADS) as pool:
        for rel, got in zip(todo, pool.map(digest, todo)):
            if isinstance(got, Exception):
                changes.append(Change(rel, "unreadable", str(got)))
            elif got != recorded[rel].sha256:
                changes.append(Change(rel, "changed"))
    return sorted(changes, key=lambda c: c.path)


def summarize(stage: str, changes: list[Change]) -> str:
    """One line: the first changed file, and how many more."""
    first = changes[0].describe(stage)
    more = len(changes) - 1
    return first + (f" (and {more} more file{'s' if more > 1 else ''})" if more else "")


# safetensors' dtype names (the header's "dtype" field)
_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
              "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def write_stable_safetensors(f, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Stream ``tensors`` into the binary file ``f`` as safetensors, byte for byte what
    ``stable_safetensors(safetensors.torch.save(tensors, metadata))`` gives, one tensor at a time.

    ``save`` builds the whole file in memory (and ``stable_safetensors`` copies it once more): for a
    122k-token document KV of Qwen3-1.7B (14 GB in bf16) that is ~3 copies beside the tensors. The
    library's layout: tensors ordered by dtype size (largest first), then name; the header compact
    JSON (metadata first, sorted here), padded with spaces to a multiple of 8."""
    import json

    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for name in names:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[str(t.dtype).removeprefix("torch.")], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)
    for name in names:  # one tensor on the host at a time
        t = tensors[name].detach().to("cpu").contiguous()
        f.write(t.view(-1).view(torch.uint8).numpy().data if t.numel() else b"")


def stable_safetensors(blob: bytes) -> bytes:
    """safetensors bytes with the ``__metadata__`` keys in sorted order. The library writes that map
    in a per-process random (hash-map) order, so the same tensors and metadata gave different bytes,
    hence different digests, in every process; sorted, equal content has equal digests. The header
    keeps its length (same characters, reordered), so the tensor offsets stay valid."""
    import json

    n = int.from_bytes(blob[:8], "little")
    raw = blob[8: 8 + n]
    header = json.loads(raw)
    meta = header.get("__metadata__")
    if not meta:
        return blob
    header["__metadata__"] = dict(sorted(meta.items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > n:  # not the compact form the library writes: leave the file as it was
        return blob
    return blob[:8] + text + b" " * (n - len(text)) + blob[8 + n:]
