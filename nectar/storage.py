"""The one atomic write: every artifact file goes through ``atomic_write``.

A reader must never see half a file: the bytes go to ``<path>.tmp`` and are renamed into place, so
a process killed mid-write leaves only the temp file (which nothing reads). Works on local disk and
on any fsspec filesystem (on object stores the rename is a copy + delete, still all-or-nothing for
readers of the final name). Returns the sha256 of the bytes written, computed while writing, so
callers can record a content digest without reading the file back.

While a stage runs, ``written_digests`` watches its folder: every file written here under it is
remembered with its digest, size and mtime, and the stage's manifest takes the digests from there
instead of reading the files again (nectar/integrity.py).
"""
from __future__ import annotations

import hashlib
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

Writer = Callable[[BinaryIO], None]


class _HashingFile:
    """A write-only file wrapper that hashes what passes through (for writers like pq.write_table)."""

    def __init__(self, f: BinaryIO):
        self._f, self.sha = f, hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += memoryview(data).nbytes
        return self._f.write(data)

    def __getattr__(self, name):  # tell/flush/closed/… go to the real file
        return getattr(self._f, name)


def atomic_write(url: str, data: bytes | str | Writer) -> str:
    """Write ``data`` (bytes, text, or a function that writes into a binary file) to ``url``
    atomically; return the sha256 hex digest of the bytes written."""
    fs, path = fsspec.core.url_to_fs(url)
    fs.makedirs(fs._parent(path), exist_ok=True)
    tmp = path + ".tmp"
    with fs.open(tmp, "wb") as raw:
        f = _HashingFile(raw)
        if callable(data):
            data(f)  # type: ignore[arg-type]
        else:
            f.write(data.encode() if isinstance(data, str) else data)
    fs.mv(tmp, path)
    digest = f.sha.hexdigest()
    _LOG.record(fs, path, digest, f.size)
    return digest


# ----------------------------------------------------------------- digests of files as they are written

@dataclass(frozen=True)
class Written:
    sha256: str
    size: int
    mtime: float | None  # what the filesystem reported right after the write (None: it doesn't say)


def canonical(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """One spelling per file, whatever URL form reached it (relative paths, file://, …)."""
    return fs.unstrip_protocol(fs._strip_protocol(path))


def file_mtime(fs: fsspec.AbstractFileSystem, path: str) -> float | None:
    """Modification time in ns for local files (cheap, exact), else what fsspec's info says."""
    if isinstance(fs, LocalFileSystem):
        return float(os.stat(path).st_mtime_ns)
    info = fs.info(path)
    value = info.get("mtime", info.get("LastModified", info.get("created")))
    return None if value is None else float(value.timestamp() if hasattr(value, "timestamp") else value)


class _DigestLog:
    """Digests of the files ``atomic_write`` wrote under the folders being watched (thread-safe:
    stages write from helper threads too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._roots: dict[str, int] = {}
        self._seen: dict[str, Written] = {}

    def record(self, fs, path: str, sha: str, size: int) -> None:
        if not self._roots:
            return
        key = canonical(fs, path)
        if not any(key.startswith(root) for root in list(self._roots)):
            return
        try:
            mtime = file_mtime(fs, path)
        except (OSError, FileNotFoundError):
            return
        with self._lock:
            self._seen[key] = Written(sha, size, mtime)

    @contextmanager
    def watch(self, url: str) -> Iterator[dict[str, Written]]:
        """Remember digests of files written under ``url`` until the block ends; yields the record
        (canonical URL → Written), which stays readable after the block."""
        fs, path = fsspec.core.url_to_fs(url)
        root = canonical(fs, path).rstrip("/") + "/"
        with self._lock:
            self._roots[root] = self._roots.get(root, 0) + 1
        seen: dict[str, Written] = {}
        try:
            yield seen
        finally:
            with self._lock:
                self._roots[root] -= 1
                if not self._roots[root]:
                    del self._roots[root]
                for key in [k for k in self._seen if k.startswith(root)]:
                    seen[key] = self._seen.pop(key) if root not in self._roots else self._seen[key]


_LOG = _DigestLog()
written_digests = _LOG.watch
