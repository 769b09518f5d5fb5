"""Data-parallel training entry point for ``torchrun``:

    torchrun --nproc_per_node=2 -m nectar.training.launch \\
        --targets RUN/targets --out RUN/train --model embedded:smollm2-135m \\
        [--doc-kv RUN/targets/doc_kv.safetensors] [--train-config train.json]

Every process loads the base model, reads its share of each global batch and trains; DDP keeps the
module replicas identical, which is checked at the end (a parameter checksum per rank).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch


def param_checksum(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", required=True, help="targets stage folder or targets.zarr")
    ap.add_argument("--out", required=True, help="output folder (module, log, checkpoints)")
    ap.add_argument("--model", default="embedded:smollm2-135m")
    ap.add_argument("--doc-kv", default=None, help="cached document KV (needed for quadrature)")
    ap.add_argument("--train-config", default=None, help="JSON or YAML file with a TrainConfig")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per process")
    args = ap.parse_args(argv)

    from ..base_model import load_base_model
    from ..modules.io import load_module
    from ..schemas.config import ModelConfig, TrainConfig
    from .distributed import init_from_env

    info = init_from_env()
    world = info.world_size
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    cfg = TrainConfig()
    if args.train_config:
        import yaml

        with open(args.train_config) as f:
            cfg = TrainConfig.model_validate(yaml.safe_load(f) or {})
    base = load_base_model(ModelConfig(name=args.model))
    doc_kv = None
    if args.doc_kv:
        from ..attention.doc_kv import load_doc_kv

        from ..targets.store import open_targets, targets_zarr_url

        header = open_targets(targets_zarr_url(args.targets))[1]
        doc_kv = load_doc_kv(args.doc_kv, base, {"model_hash": base.weights_hash,
                                                 "doc_sha256": header.doc_sha256})
    from .fit import fit

    module, counts = fit(args.targets, cfg, base, doc_kv, args.out)
    checksum = replica_checksum(module, info)
    saved, _ = load_module(args.out, base)  # rank 0 wrote it
    report = {"rank": info.rank, "world_size": world, "replica_checksum": checksum,
              "file_checksum": param_checksum(saved), **counts}
    reports = [report]
    if world > 1:  # one line from rank 0: the ranks' prints would interleave on a shared stdout
        import torch.distributed as dist

        reports = [None] * world
        dist.all_gather_object(reports, report)
        dist.destroy_process_group()
    if info.is_main:
        print(json.dumps({"ranks": reports}), flush=True)
    return 0


def replica_checksum(module: torch.nn.Module, info) -> str:
    """Checksum of this rank's replica, compared across ranks (raises if any differ)."""
    mine = param_checksum(module)
    if info.active:
        import torch.distributed as dist

        all_sums: list[str | None] = [None] * info.world_size
        dist.all_gather_object(all_sums, mine)
        if len(set(all_sums)) != 1:
            raise RuntimeError(f"data-parallel replicas diverged: parameter checksums {all_sums}")
    return mine


if __name__ == "__main__":
    sys.exit(main())
