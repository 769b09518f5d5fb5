"""Queries made from the document itself, no LLM needed: held-out probes (``probes.py``: verbatim
continuations and lookups, docs/design.md §11) and the reconstruction spans (``recon.py``: the
document asked back span by span, what the default state's selection reads)."""
