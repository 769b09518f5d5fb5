"""Artifacts passed between stages: parquet row schemas, headers and manifests.

Row schemas validate every row on write and on read (``nectar.tables``); headers validate the
attributes of Zarr groups and module files.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from .base import Artifact
from .config import ProbeKind, TaskType

__all__ = [
    "DocumentInfo", "ChunkRow", "PairRow", "DatasetRow", "ProbeRow", "Verdict", "Split",
    "StageManifest", "RunManifest", "TargetsHeader", "TargetsPairRow", "ModuleSpec",
    "TrainLogRow", "MetricsRow", "GenerationRow", "JudgmentRow", "PerLayerRow", "BenchmarkRow", "BenchSystem",
    "ComparisonRow", "QualityColumns",
]


class DocumentInfo(Artifact):
    """The document a run is about (``document/info.json``)."""

    schema_version: int = 1
    doc_id: str
    source_uri: str
    sha256: str
    n_chars: int
    n_words: int
    n_context_tokens: int  # n: template prefix + document, under the run's base model
    model: str


class ChunkRow(Artifact):
    schema_version: int = 1
    chunk_id: int
    start_word: int  # inclusive index into the document's whitespace-split words
    end_word: int  # exclusive
    n_words: int
    text: str


class PairRow(Artifact):
    """One synthesized instruction/response pair, or one failed request (parse_error set)."""

    schema_version: int = 1
    pair_id: str
    chunk_id: int
    task: TaskType
    instruction: str
    response: str
    raw_output: str  # the model's full output, kept beside the parsed fields
    parse_error: str | None = None


Verdict = Literal[
    "consistent", "inconsistent", "insufficient_context", "low_confidence",
    "judge_parse_error", "duplicate", "synthesis_parse_error", "probe", "recon",
    # verify.method = evidence (judge-free, nectar/evaluation/evidence.py): the document raises the
    # answer's likelihood and the full-context model answers alike (kept) / it does not / it answers otherwise
    "grounded", "ungrounded", "disagrees",
]
# "probes": held-out document probes (never trained on); train probes are split "train".
# "recon": reconstruction spans (nectar/queries/recon.py), training queries of their own.
Split = Literal["train", "test", "probes", "dropped", "recon"]


class DatasetRow(Artifact):
    """A pair after verification. Dropped rows stay in the table with their verdict."""

    schema_version: int = 1
    pair_id: str
    chunk_id: int
    task: TaskType
    instruction: str
    response: str
    full_answer: str  # the long-context model's answer with the whole document
    judge_raw: str
    is_consistent: bool | None
    confidence: float | None
    reasoning: str
    verdict: Verdict
    kept: bool
    kept_by_floor: bool = False  # kept below the confidence threshold to reach verify.min_kept
    # verify.method = evidence: log p(answer | document, q) − log p(answer | q) per answer token (nats),
    # and ROUGE-L F1 of the answer against the full-context model's answer
    evidence_gain: float | None = None
    agreement: float | None = None
    split: Split
    challenge: bool = False
    max_train_similarity: float | None = None


class FileDigest(Artifact):
    """One output file's content digest, as its stage's manifest records it (a part of
    StageManifest, versioned with it: no schema_version of its own, a manifest lists thousands)."""

    sha256: str
    size: int


# pair_split codes in the targets group (one int8 per pair).
SPLIT_CODES: dict[str, int] = {"train": 0, "test": 1, "probes": 2, "recon": 3}


class ProbeRow(Artifact):
    """A document probe (nectar/queries/probes.py): instruction and verbatim response from the text."""

    schema_version: int = 1
    probe_id: str
    kind: ProbeKind
    instruction: str
    response: str
    first_unit: int  # the document units (sentences, headings, items) it reads and writes
    last_unit: int
    split: Literal["train", "probes"]


class StageManifest(Artifact):
    """Written last and atomically into a stage folder: its presence means the stage completed."""

    schema_version: int = 1
    stage: str
    cache_key: str
    config: dict[str, Any]
    inputs: dict[str, str]  # name → content hash
    outputs: dict[str, str]  # declared output (file or folder) → content digest (nectar/integrity.py)
    code_version: str
    counts: dict[str, Any] = Field(default_factory=dict)
    started_at: str
    finished_at: str
    duration_s: float
    # every file of the outputs (folders expanded: each Zarr shard) → its digest; checked before
    # the stage counts as cached. Empty in manifests of older releases (they are never cached).
    files: dict[str, FileDigest] = Field(default_factory=dict)


class RunManifest(Artifact):
    schema_version: int = 1
    doc_id: str
    run_id: str
    source_uri: str
    config: dict[str, Any]
    code_version: str
    created_at: str
    parent_run: str | None = None  # sweep variants: the run whose data stages (chunk…targets) they share


class TargetsHeader(Artifact):
    """Attributes of ``targets/targets.zarr``.

    Arrays (token-major, T = total query tokens over all pairs; P = pairs):
      q [T, L, Hq, d], A [T, L, Hq, d] in ``dtype`` (bfloat16: stored as a uint16 view, zarr has no
        bf16), alpha [T, L, Hq] float32 (float16 in stores written before bfloat16 existed);
        absent with ``mode`` "online" (training recomputes them from the document KV)
      topk_ids [T, K] int32, topk_logprobs [T, K] float32  (teacher's next-token top-K at t; with
        topk_scope "kl_positions" only where token t+1 is a response token — the positions the
        KL loss reads — and zeros elsewhere)
      token_ids [T] int32, positions [T] int32 (n … n+m-1), response_mask [T] bool
      pair_offsets [P+1] int64, pair_split [P] int8 (SPLIT_CODES: 0 = train, 1 = test, 2 = probes, 3 = recon)
    Pair p's tokens are rows pair_offsets[p]:pair_offsets[p+1]; targets/pairs.parquet lists them.
    """

    schema_version: int = 1
    model: str
    model_hash: str
    doc_sha256: str
    n_context: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    top_k: int
    dtype: Literal["float32", "float16", "bfloat16"]
    n_pairs: int
    n_tokens: int
    split_pairs: dict[str, int]
    topk_scope: Literal["all", "kl_positions"] = "all"
    mode: Literal["cached", "online"] = "cached"
    complete: bool = False


class TargetsPairRow(Artifact):
    schema_version: int = 1
    index: int
    pair_id: str
    task: TaskType
    split: Literal["train", "test", "probes", "recon"]
    challenge: bool
    start: int
    length: int
    response_start: int  # offset within the pair of the first response token
    truncated: bool


class ModuleSpec(Artifact):
    """The JSON beside a module's safetensors: enough to rebuild it and check it fits the model."""

    schema_version: int = 1
    base_model: str
    base_model_hash: str
    doc_sha256: str
    n_context: int
    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    scaling: float
    arch: Literal["mlp", "quadrature"]
    module_config: dict[str, Any]
    rho: float
    per_layer_params: list[int]  # per KV-head parameter count, one entry per layer
    n_params: int
    module_bytes: int
    kv_cache_bytes: int  # bytes of the document KV cache this module replaces (same dtype)
    normalization: dict[str, Any] = Field(default_factory=dict)


class TrainLogRow(Artifact):
    schema_version: int = 1
    step: int
    samples: int
    split: Literal["train", "heldout"]
    lr: float
    loss: float
    loss_alpha: float
    loss_A: float
    loss_kl: float
    rte_A: float | None = None
    rte_alpha: float | None = None
    token_acc: float | None = None
    grad_norm: float | None = None
    skipped_nonfinite: int = 0


class QualityColumns(Artifact):
    """The quality columns a metrics row (one model, ``evaluate``) and a comparison row (one system at
    one budget, ``compare``) share, on one split: teacher-forced metrics with 95 % paired bootstrap
    intervals over pairs (nectar/evaluation/quality.py; None where undefined, e.g. < 2 pairs), and
    greedy-generation agreement with the full-context model over ``n_agreement`` prompts.

    Version 2 of both tables (these columns first, in this order); version-1 files still read (their
    columns are read by name)."""

    SCHEMA_VERSION: ClassVar[int] = 2
    READS_VERSIONS: ClassVar[tuple[int, ...]] = (1, 2)

    schema_version: int = 2
    split: str
    n_pairs: int | None = None
    n_tokens: int
    token_acc: float | None = None
    token_acc_ci_low: float | None = None
    token_acc_ci_high: float | None = None
    cross_entropy: float | None = None
    cross_entropy_ci_low: float | None = None
    cross_entropy_ci_high: float | None = None
    kl_to_full: float | None = None
    kl_ci_low: float | None = None
    kl_ci_high: float | None = None
    recovered_kl: float | None = None  # 1 − KL_model / KL_none
    recovered_kl_ci_low: float | None = None
    recovered_kl_ci_high: float | None = None
    n_agreement: int = 0
    agreement_exact: float | None = None
    agreement_exact_ci_low: float | None = None
    agreement_exact_ci_high: float | None = None
    agreement_rouge_l: float | None = None
    agreement_rouge_l_ci_low: float | None = None
    agreement_rouge_l_ci_high: float | None = None
    agreement_cosine: float | None = None
    agreement_cosine_ci_low: float | None = None
    agreement_cosine_ci_high: float | None = None

    @classmethod
    def quality(cls, columns: dict[str, Any]) -> dict[str, Any]:
        """The entries of ``columns`` (``SystemQuality.columns()``) that are quality columns."""
        return {k: v for k, v in columns.items() if k in QualityColumns.model_fields and k != "schema_version"}


class MetricsRow(QualityColumns):
    """Teacher-forced metrics of one model on one split (``evaluate``: metrics.parquet); a model is
    always scored, so its accuracy, cross-entropy and KL are numbers."""

    model: Literal["module", "full", "none"]
    token_acc: float
    cross_entropy: float
    kl_to_full: float


class GenerationRow(Artifact):
    schema_version: int = 1
    pair_id: str
    split: str
    task: TaskType
    instruction: str
    ground_truth: str
    module_output: str
    full_output: str


class JudgmentRow(Artifact):
    schema_version: int = 1
    pair_id: str
    split: str
    task: TaskType
    comparison: Literal["module_vs_truth", "base_vs_truth", "module_vs_base"]
    score: int | None
    reasoning: str
    raw: str
    parse_error: str | None = None


BenchSystem = Literal["module", "full_cached", "full_cold"]


class PerLayerRow(Artifact):
    """App. C diagnostics of the module for one (split, layer, query head), over cached queries."""

    schema_version: int = 1
    split: str
    layer: int
    q_head: int
    kv_head: int
    mse_alpha: float  # E_q (a_θ(q) − α(q))²
    mse_A: float  # E_q ‖A_θ(q) − A(q)‖² (the paper's L_A for this head)
    rte_alpha: float  # E_q log((a_θ − α)² / α²)
    rte_A: float  # E_q log(‖A_θ − A‖² / ‖q − A‖²)   (App. C eq. rte)
    n_tokens: int


class BenchmarkRow(Artifact):
    """One generation-benchmark measurement (paper App. F): one system at one document length."""

    schema_version: int = 1
    n_context: int
    system: BenchSystem  # module | full KV cache already computed | full KV cache prefilled first
    ttft_s: float  # time to first token (cold: includes the document prefill)
    decode_tok_s: float
    peak_memory_bytes: int
    memory_method: str
    state_bytes: int  # bytes standing in for the document: module parameters or the KV cache
    prompt_tokens: int
    new_tokens: int
    repeats: int
    device: str
    note: str = ""  # e.g. "random-init module of the same architecture (timing only)"


class ComparisonRow(QualityColumns):
    """One system at one budget ρ on one split (``nectar compare``: compare/comparison.parquet).

    Quality columns as in MetricsRow (every system of a split is resampled on the same pairs).
    ``none`` and ``full`` are reference rows with rho None.
    """

    n_pairs: int
    kl_to_full: float | None
    system: str
    # reference: none / full; trained: a module trained for the comparison; method: a state method of
    # nectar/states fitted at compare time (the outside baselines and the product's own recon_fit family);
    # kvpress: a kvpress press; run: the run's own first / refined state; served: the run's state as vLLM
    # serves it (its KL over kl_basis). "baseline": the old name of "method", in tables written before it was renamed.
    kind: Literal["reference", "trained", "method", "kvpress", "run", "served", "baseline"]
    regime: str | None = None  # training regime of a trained system (nectar/schemas/presets.py REGIMES)
    arch: str | None = None
    rho: float | None = None  # the budget: share of the document KV bytes (None for none/full)
    state_bytes: int  # bytes standing in for the document: 0 (none), the KV cache (full), the module/baseline
    train_seconds: float | None = None  # training (trained), fitting (baseline) or press (kvpress) time
    # seconds from the document to a usable state: the document's prefill (full); the data stages
    # (chunk → targets, from the run's manifests) plus training (trained) or the fit (baselines that
    # read the captured queries); the fit alone (truncate); the press alone (kvpress); the run's own
    # stages up to it (run: chunk → first for the first state, every stage through promote for the refined)
    state_seconds: float | None = None
    source: str | None = None  # where the module came from: its run directory, or the baseline's fit
    # what the KL columns are over: None, the full vocabulary; "top-100 buckets" (a served row): the server's
    # top 100 tokens at each position and the rest of the vocabulary as one bucket (a lower bound of the full
    # KL, not comparable with full-vocabulary rows; compare it with the torch engine's figure on the same buckets)
    kl_basis: str | None = None
