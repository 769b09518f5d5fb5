"""Running the pipeline's stages on a run directory — the logic the Prefect flows and the CLI wrap.

No Prefect import here. Three parts:
  context.py  the run directory's lifecycle: prepare (validate the document, write run.json) and reopen
  stages.py   stage wiring: each ``run_<stage>`` resolves its inputs from upstream manifests, builds
              the stage's cache key and calls the pure stage function through ``runs.run_stage``
  readers.py  what dashboards read back from a run (sample rows, evaluation tables)
"""
from .context import RunContext, StageInputError, default_run_dir, load_run_doc_kv, open_run, prepare_run
from .readers import read_eval_tables, stage_extra_tables, stage_samples
from .stages import (SHARED_DATA_STAGES, STAGE_RUNNERS, UPSTREAM, available_stages, plan_stages, run_chunk,
                     run_evaluate, run_synthesize, run_targets, run_train, run_verify)

__all__ = ["RunContext", "StageInputError", "default_run_dir", "load_run_doc_kv", "open_run", "prepare_run",
           "read_eval_tables", "stage_extra_tables", "stage_samples", "SHARED_DATA_STAGES", "STAGE_RUNNERS",
           "UPSTREAM", "available_stages", "plan_stages", "run_chunk", "run_evaluate", "run_synthesize",
           "run_targets", "run_train", "run_verify"]
