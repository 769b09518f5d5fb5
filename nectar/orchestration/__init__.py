"""Running the pipeline's stages on a run directory — the logic the Prefect flows and the CLI wrap.

No Prefect import here. The parts:
  executor.py run directories, stage manifests and cache-keyed stage execution (``run_stage``)
  context.py  the run directory's lifecycle: check (the document, the window, the directory's owner),
              prepare (write run.json) and reopen
  lock.py     one writer per run directory
  lineage.py  the code a stage runs, as a digest for its cache key
  runners.py  stage wiring: each ``run_<stage>`` resolves its inputs from upstream manifests, builds
              the stage's cache key and calls the pure stage function through ``executor.run_stage``
  readers.py  what dashboards read back from a run (sample rows, evaluation tables)
  document_run.py  one document through the stages (plan → lock → each stage → manifests): the core
              the CLI, the flows, sweeps and the reliability tests call
"""
from .context import (CheckedRun, RunContext, RunDirMismatch, StageInputError, check_request, check_run,
                      default_run_dir, load_run_doc_kv, open_run, prepare_run)
from .document_run import (DocumentRequest, DocumentRun, RunOne, open_document, plan_document, run_document,
                           run_here)
from .lock import RunLocked, run_lock
from .readers import read_eval_tables, stage_extra_tables, stage_samples
from .runners import (SHARED_DATA_STAGES, STAGE_RUNNERS, UPSTREAM, available_stages, check_inputs_done, llm_scope,
                      plan_stages, run_chunk,
                     run_evaluate, run_synthesize, run_targets, run_train, run_verify)

__all__ = ["DocumentRequest", "DocumentRun", "RunOne", "open_document", "plan_document", "run_document",
           "run_here", "CheckedRun", "RunDirMismatch", "check_request", "check_run", "RunLocked", "run_lock",
           "RunContext", "StageInputError", "default_run_dir", "load_run_doc_kv", "open_run", "prepare_run",
           "read_eval_tables", "stage_extra_tables", "stage_samples", "SHARED_DATA_STAGES", "STAGE_RUNNERS",
           "UPSTREAM", "available_stages", "check_inputs_done", "llm_scope", "plan_stages", "run_chunk", "run_evaluate",
           "run_synthesize", "run_targets", "run_train", "run_verify"]
