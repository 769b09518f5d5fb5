"""The one atomic write: every artifact file goes through ``atomic_write``.

A reader must never see half a file: the bytes go to ``<path>.tmp`` and are renamed into place, so
a process killed mid-write leaves only the temp file (which nothing reads). Works on local disk and
on any fsspec filesystem (on object stores the rename is a copy + delete, still all-or-nothing for
readers of the final name). Returns the sha256 of the bytes written, computed while writing, so
callers can record a content digest without reading the file back.
"""
from __future__ import annotations

import hashlib
from typing import BinaryIO, Callable

import fsspec

Writer = Callable[[BinaryIO], None]


class _HashingFile:
    """A write-only file wrapper that hashes what passes through (for writers like pq.write_table)."""

    def __init__(self, f: BinaryIO):
        self._f, self.sha = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
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
    return f.sha.hexdigest()
