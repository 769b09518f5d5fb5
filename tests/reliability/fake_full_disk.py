"""A FAKE size-limited fsspec filesystem (``fulldisk://``) for failure injection: an in-memory store
whose writes fail with ENOSPC ("No space left on device") once ``FullDiskFS.quota`` bytes are used."""
from __future__ import annotations

import errno
import os

import fsspec
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

PROTOCOL = "fulldisk"


class _QuotaFile(MemoryFile):
    def write(self, data) -> int:
        fs = self.fs
        used = sum(f.size for p, f in fs.store.items() if p != self.path) + self.tell() + memoryview(data).nbytes
        if fs.quota is not None and used > fs.quota:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        return super().write(data)


class FullDiskFS(MemoryFileSystem):
    protocol = PROTOCOL
    store: dict = {}  # its own files, not memory://'s
    pseudo_dirs = [""]
    quota: int | None = None  # bytes; None = unlimited

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith(f"{PROTOCOL}://"):
            path = "memory://" + path[len(PROTOCOL) + 3:]
        return super()._strip_protocol(path)

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        if mode in {"wb", "w+b", "xb", "x+b"}:
            path = self._strip_protocol(path)
            if "x" in mode and self.exists(path):
                raise FileExistsError(path)
            f = _QuotaFile(self, path, None)
            data = kwargs.get("data")
            if data:
                f.write(data)
                f.seek(0)
            f.commit()
            return f
        return super()._open(path, mode, block_size, autocommit, cache_options, **kwargs)

    @classmethod
    def used(cls) -> int:
        return sum(f.size for f in cls.store.values())

    @classmethod
    def reset(cls, quota: int | None = None) -> None:
        cls.store.clear()
        cls.pseudo_dirs[:] = [""]
        cls.quota = quota


fsspec.register_implementation(PROTOCOL, FullDiskFS, clobber=True)
