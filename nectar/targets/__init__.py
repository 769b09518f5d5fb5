"""Capturing attention targets (q, α, A) and teacher top-K into a sharded Zarr v3 group."""
