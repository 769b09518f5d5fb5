"""NECTAR: per-document neural modules that replace attention over a long document's KV cache."""

__version__ = "0.2.0"
