"""Names that changed, and what they are read as: the ONE legacy-alias table.

The product's state method was called ``kvzip`` (regime, ``train.module.init``, the compare systems
``kvzip_select…``, ``kvzip_fit…``); it is ``recon_fit`` now, so that "KVzip" means only kvpress's
KVzip press (``kvpress:kvzip``) and the paper it implements. Old configs, ``--regime`` / ``--systems``
arguments and old run directories keep loading: each old name is read as its new one, said once per
process on stderr. Configs are validated with the new name, so the stage cache keys and run ids of an
old config and a new one agree (docs/architecture.md, "Renamed").
"""
from __future__ import annotations

import sys
from typing import Literal

Kind = Literal["regime", "init", "method", "system"]

# (kind, old name) → new name
RENAMED: dict[tuple[str, str], str] = {
    ("regime", "kvzip"): "recon_fit",
    ("init", "kvzip"): "recon_fit",
    ("method", "kvzip"): "recon_fit",
    ("system", "kvzip"): "recon_fit_regime",  # the train stage's state (regime recon_fit)
}
# (kind, old prefix) → new prefix: kvzip_fit_qa@int4 → recon_fit_qa@int4, kvzip_select → recon_select, …
RENAMED_PREFIXES: dict[tuple[str, str], str] = {
    ("system", "kvzip_"): "recon_",
}

_said: set[tuple[str, str]] = set()  # (old, new): one line per renaming, whatever kinds read it


def renamed(kind: Kind, name: str) -> str:
    """``name``'s current spelling (itself when it was never renamed); an old one is noted on stderr once."""
    new = RENAMED.get((kind, name))
    if new is None:
        for (k, old), prefix in RENAMED_PREFIXES.items():
            if k == kind and name.startswith(old):
                new = prefix + name[len(old):]
                break
    if new is None:
        return name
    if (name, new) not in _said:
        _said.add((name, new))
        # written, not printed: inside a Prefect flow ``log_prints`` turns a print into a log record too
        sys.stderr.write(f"note: {name!r} is read as {new!r} (renamed; docs/architecture.md)\n")
        sys.stderr.flush()
    return new
