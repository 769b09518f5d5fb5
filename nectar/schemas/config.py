"""Stage and pipeline configurations (frozen pydantic models).

Every stage function takes its own config plus flat arguments; nothing here is stored inside an
``nn.Module``. Presets live in ``presets.py``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import FrozenConfig, added_setting, resource
from .renamed import renamed

SynthesisTask = Literal["qa", "summarization", "quoting", "paraphrasing"]
TASK_TYPES: tuple[SynthesisTask, ...] = ("qa", "summarization", "quoting", "paraphrasing")
ProbeKind = Literal["continue", "locate"]
TaskType = Literal["qa", "summarization", "quoting", "paraphrasing", "continue", "locate", "recon"]
# "first": a state from the document alone, servable before self-study; "promote": the refined
# (train) state replaces it when better on the held-out pairs (nectar/stages/first.py, promote.py)
STAGES: tuple[str, ...] = ("chunk", "first", "synthesize", "verify", "targets", "train", "promote", "evaluate")


# RoPE types whose rotation is fixed per position. ``dynamic`` and ``longrope`` change the
# frequencies with the length of the sequence in the forward, so a document KV computed once (and
# query-only forwards at positions n…) would be rotated differently from a full forward.
STATIC_ROPE_TYPES: tuple[str, ...] = ("linear", "yarn", "llama3")


class ModelConfig(FrozenConfig):
    """The frozen base model. ``name`` is ``embedded:smollm2-135m``, ``tiny:llama``/``tiny:qwen2``/``tiny:qwen3``
    (random weights built in-process, for tests), an HF model id or a local directory."""

    name: str = "embedded:smollm2-135m"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # YaRN factor applied identically everywhere the model is loaded (paper §4.1: x4 for Qwen3);
    # shorthand for rope_scaling {rope_type: yarn, factor: F} over the model's own window.
    yarn_factor: float | None = Field(None, ge=1.0)
    # RoPE scaling merged into the model's own RoPE parameters (its rope_theta is kept), e.g.
    # {rope_type: yarn, factor: 4, original_max_position_embeddings: 32768} for Qwen3. Static types
    # only (yarn, linear, llama3): the document KV is computed once, so the rotation can't depend on
    # the sequence length (dynamic, longrope). See nectar/base_model.py ``apply_rope_scaling``.
    rope_scaling: dict[str, Any] | None = None
    # Refuse documents + query longer than this many tokens (default: the model's trained window,
    # scaled by the RoPE factor when set).
    max_context_tokens: int | None = None
    device: str = resource("auto")
    # "auto": flash-attn on CUDA when installed, else torch's fused kernel on CUDA, else exact torch math.
    attention_backend: Literal["auto", "torch", "fused", "flash"] = resource("auto")

    @model_validator(mode="after")
    def _one_rope_setting(self) -> "ModelConfig":
        if self.yarn_factor is not None and self.rope_scaling is not None:
            raise ValueError("set model.yarn_factor or model.rope_scaling, not both "
                             "(yarn_factor F is rope_scaling {rope_type: yarn, factor: F})")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in STATIC_ROPE_TYPES:
                raise ValueError(f"rope_scaling.rope_type {rope_type!r} is not supported; use one of "
                                 f"{list(STATIC_ROPE_TYPES)} (the document KV is computed once, so the "
                                 "rotation must not depend on the sequence length)")
            factor = self.rope_scaling.get("factor")
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
                raise ValueError(f"rope_scaling.factor must be a number >= 1, got {factor!r}")
        return self


class LLMConfig(FrozenConfig):
    """One chat endpoint: in-process transformers (``local``), an OpenAI-compatible server
    (``openai``), or vLLM (``vllm``: a server the pipeline starts and stops, or the one at
    ``base_url``). ``auto`` is vLLM when it can be set up and started, else ``local`` (one line says so)."""

    backend: Literal["local", "openai", "vllm", "auto"] = "local"
    # openai: the served model name. local / vllm: None means the pipeline's base model.
    model: str | None = None
    # openai: the server. vllm: a server someone else runs (None: the pipeline starts one).
    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    temperature: float = 0.7
    top_p: float = 0.95
    max_new_tokens: int = 512
    structured_output: bool = True
    seed: int = 0
    max_concurrency: int = resource(8)
    batch_size: int = resource(8)
    max_retries: int = resource(3)
    timeout_s: float = resource(300.0)  # one attempt
    retry_budget_s: float = resource(900.0)  # one request's attempts and waits together (openai backend)
    # vllm, managed server: its context length and weights dtype (what it can answer), its port
    # (0: a free one) and KV-cache space in GiB on CPU (VLLM_CPU_KVCACHE_SPACE; how fast, not what).
    max_model_len: int = Field(8192, gt=0)
    server_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    port: int = resource(0, ge=0, le=65535)
    kv_cache_gib: float = resource(2.0, gt=0)
    # torch.compile the served model: faster decode after a compile of minutes (every start with
    # vllm-cpu 0.32); off, the server is up in about a minute.
    server_compile: bool = resource(False)
    # A managed server that dies mid-stage is restarted this many times (the unanswered requests asked
    # again), then auto finishes the stage on the local loop and vllm stops with the reason.
    max_server_restarts: int = resource(2, ge=0)
    # vLLM's own limit on one engine step (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS; vLLM's default, 300 s,
    # kills the engine of a loaded 2-core machine compiling a decode shape).
    execute_timeout_s: int = resource(1800, gt=0)


class ChunkConfig(FrozenConfig):
    words: int = Field(2000, gt=0)
    overlap: int = Field(200, ge=0)

    @model_validator(mode="after")
    def _overlap_below_size(self) -> "ChunkConfig":
        if self.overlap >= self.words:
            raise ValueError(f"chunk.overlap ({self.overlap}) must be smaller than chunk.words ({self.words})")
        return self


class SynthesizeConfig(FrozenConfig):
    counts: dict[SynthesisTask, int] = Field(
        default_factory=lambda: {"qa": 5, "summarization": 1, "quoting": 2, "paraphrasing": 2}
    )
    max_chunks: int | None = None  # cap for quick runs; None = every chunk
    # Upper bound on each string of the structured output (scratchpad, instruction, response):
    # the paper asks for < 300 words per pair; small models otherwise run past their token budget.
    max_field_chars: int = Field(600, gt=0)
    # Samples drawn per (chunk, task) prompt, each with its own pairs (vLLM: one request with n).
    samples_per_chunk: int = Field(1, ge=1)
    llm: LLMConfig = LLMConfig(temperature=0.7, top_p=0.95, max_new_tokens=1024)


class VerifyConfig(FrozenConfig):
    min_confidence: float = 0.7
    test_fraction: float = 0.2
    # challenge split size: the test instructions least similar to any training instruction.
    challenge_size: int = 500
    seed: int = 0
    answer_llm: LLMConfig = LLMConfig(temperature=0.0, max_new_tokens=256)
    judge: LLMConfig = LLMConfig(temperature=0.0, max_new_tokens=256)
    embedder: str = "embedded:all-minilm-l6-v2"
    # Tiny models produce few consistent pairs; when set, keep at least this many pairs by taking
    # the most confident consistent ones below the threshold (recorded as kept_by_floor).
    min_kept: int = 0
    # judge: the paper's LLM judge of consistency (a capable judge: GPU). evidence: judge-free, on the
    # base model (nectar/evaluation/evidence.py): keep a pair when the document adds at least
    # ``min_gain`` nats per answer token to its likelihood and its answer agrees with the full-context
    # model's (ROUGE-L F1 ≥ ``min_agreement``); the floor, ranked by gain, only when too few pass.
    method: Literal["judge", "evidence"] = added_setting("judge")
    min_gain: float = added_setting(0.5)
    min_agreement: float = added_setting(0.1, ge=0, le=1)
    evidence_max_tokens: int = added_setting(384, ge=16)  # query tokens scored per pair (its start)


class ProbesConfig(FrozenConfig):
    """Document probes (nectar/queries/probes.py): queries made from the document, no LLM."""

    held_out: bool = True  # cache held-out probes (split "probes") for evaluation
    train: bool = False  # also train on probes of the other positions (split "train")
    kinds: tuple[ProbeKind, ...] = ("continue", "locate")
    held_out_fraction: float = Field(0.5, gt=0, lt=1)  # share of the document's positions held out
    block_units: int = Field(4, ge=1)  # positions are assigned to train / held-out in blocks of units
    min_prompt_words: int = Field(4, ge=1)
    min_response_words: int = Field(12, ge=1)
    max_response_units: int = Field(3, ge=1)
    phrase_words: int = Field(3, ge=2)
    locate_per_unit: int = Field(2, ge=1)  # distinct unique phrases asked about per unit
    seed: int = 0


class ReconConfig(FrozenConfig):
    """Reconstruction queries (nectar/queries/recon.py): spans tiling the document, each prompted with
    the words before it and answered with the span verbatim (KVzip's context reconstruction)."""

    capture: bool = False  # the targets stage also captures them as split "recon" (training data)
    span_words: int = Field(48, ge=4)  # a span is whole units (probes.py) of at least this many words
    cue_words: int = Field(8, ge=1)  # the prompt quotes this many words preceding the span
    # Blocks of units (probes.block_units) left out of reconstruction, drawn from the held-out probe
    # blocks: probes there (`probes_withheld` in `nectar compare`) measure what generalises rather than
    # what was reconstructed. 0 (a product state): the whole document is reconstructed, as KVzip does;
    # 0.1 measures generalisation (`--set targets.recon.withheld_fraction=0.1`, docs/quality.md).
    withheld_fraction: float = Field(0.0, ge=0, lt=1)
    seed: int = 0
    # Tilings of the document: pass 1 is the one above; each further pass tiles it again with other
    # span boundaries, span lengths and cue lengths (drawn from seed and the pass number), so more
    # reconstruction queries can be captured as training data (docs/quality.md, "The MLP with data").
    passes: int = added_setting(1, ge=1, le=1000)


class TargetsConfig(FrozenConfig):
    probes: ProbesConfig = ProbesConfig()
    recon: ReconConfig = added_setting(ReconConfig())
    top_k: int = 32
    # Storage of q and A (α stays float32): bfloat16 is kept as a uint16 view (zarr has no bf16).
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    # "online": q, α, A are not stored; training recomputes them from the document KV each step
    # (docs/artifacts.md). The stage then writes token ids, positions, masks and the teacher's top-K.
    mode: Literal["cached", "online"] = "cached"
    max_query_tokens: int = 512
    # Keep at most this many pairs (a fixed pseudo-random subset by pair id), e.g. to fit max_bytes.
    max_pairs: int | None = Field(None, ge=1)
    # The stage refuses to start when its estimated output is larger (bytes).
    max_bytes: int = resource(100 * 10**9, ge=0)
    splits: tuple[str, ...] = ("train", "test", "probes")
    chunk_tokens: int = 64  # zarr chunk along the token axis (random reads of batches)
    shard_tokens: int = 2048  # zarr shard along the token axis (one write unit)
    batch_size: int = resource(8, ge=1)  # pairs per forward at most (packed back to back, no padding)
    batch_tokens: int = resource(2048, ge=1)  # query tokens per forward at most (a longer pair runs alone)


class SelectionConfig(FrozenConfig):
    """Which document keys a quadrature state keeps and how it is fitted: the settings of the
    ``recon_fit`` state method (nectar/states/recon_fit.py, ``init: recon_fit``)."""

    # "global": one ranking across all layers and KV heads (KVzip); "layer": the plan's per-layer
    # budget shared by that layer's heads; "head": the plan's budget in every (layer, KV head).
    budget: Literal["global", "layer", "head"] = "global"
    aggregate: Literal["max", "mean"] = "max"  # a key's score over the reconstruction queries
    sink_tokens: int = Field(4, ge=0)  # the first tokens, always kept as exact KV (attention sinks)
    template_tokens: bool = False  # also keep every chat-template token of the context exact
    fit: bool = True  # closed-form β (NNLS) and values (least squares) on the kept keys
    # queries of the closed-form fit: the reconstruction spans, or those plus the targets' train split
    fit_queries: Literal["recon", "recon+train"] = "recon+train"
    # queries whose attention ranks the keys: the reconstruction spans alone (KVzip), or also the targets'
    # train queries — max of the two scores, each divided by its value at the budget's cut (reconstruction.py)
    score_queries: Literal["recon", "recon+train"] = added_setting("recon")
    # below 32 bits: fit β to the keys as stored and the values to those keys and β as stored (else
    # fit in float, then round)
    quant_aware: bool = added_setting(True)
    # the fit's reconstruction queries also placed these many positions after the document (the distances
    # a composition asks a document from when other documents follow it: ``compose`` sets them per part)
    fit_gaps: tuple[Annotated[int, Field(gt=0)], ...] = added_setting(())
    # at most this many keys of one (layer, KV head) fitted jointly: those with the most mass on the fit
    # queries; the rest keep β = 0 and their own values. The fit's solves are cubic in the keys a head
    # keeps, and a head keeping almost every key gains least from β (states/matching_fit.py). None: all
    fit_keys: Annotated[int, Field(gt=0)] | None = added_setting(None)
    # a key is scored only by the reconstruction batches whose spans lie within this many tokens of it
    # (KVzip scores a chunk's keys by that chunk's reconstruction): the scoring grows with n, not n².
    # None: every batch scores every key (states/reconstruction.py ``recon_capture``; "max" aggregate only)
    score_window: Annotated[int, Field(ge=0)] | None = added_setting(None)
    # below 32 bits, how the fitted values reach their int grid: each row to its nearest point on its own
    # ("nearest"), or row by row with each rounding error moved onto the rows not yet rounded by the value
    # fit's own least-squares objective ("gptq": states/value_rounding.py); the same bytes either way
    value_rounding: Literal["nearest", "gptq"] = added_setting("nearest")
    # which keys a head keeps, as many as the allocation gives it: its top-scored ones ("top"), or chosen
    # together from 4× that many top-scored ones for the fit they allow ("greedy": orthogonal least
    # squares on the fit queries' attention, states/greedy_keys.py; needs fit), or greedy only where keys
    # are scarce ("auto": the state keeps at most GREEDY_SHARE of the document's entries, else top)
    key_choice: Literal["top", "greedy", "auto"] = added_setting("top")
    # what the fit's ridge pulls β and the values toward where the queries leave them free: β = 0 and the
    # kept keys' own values ("kept"), or every evicted key merged into its most similar kept one ("merged":
    # β and the value carry their total mass and mass-weighted value, states/merging.py)
    fit_prior: Literal["kept", "merged"] = added_setting("kept")
    # how β and the values are made (with fit): least squares on the fit queries' attention ("least_squares",
    # states/matching_fit.py), every evicted key merged into its most similar kept one ("merge": β and the
    # value carry their total mass and mass-weighted value, states/merging.py), per (layer, KV head) whichever
    # of the two does better on a fifth of the fit queries held out of both ("choose", states/reconstruction.py
    # _HeadFit.choose), or by the share of the document's entries the state keeps ("auto": least squares up to
    # GREEDY_SHARE, chosen up to CHOOSE_SHARE, merged above; states/recon_fit.py auto_fit_by)
    fit_by: Literal["least_squares", "merge", "auto", "choose"] = added_setting("least_squares")

    @model_validator(mode="after")
    def _greedy_needs_fit(self) -> "SelectionConfig":
        if self.key_choice != "top" and not self.fit:
            raise ValueError(f"select.key_choice={self.key_choice} chooses keys for the fit on the fit queries: set "
                             "select.fit=true or key_choice=top")
        if self.fit_by != "least_squares" and not self.fit:
            raise ValueError(f"select.fit_by={self.fit_by} makes β and the values from the fit queries: set "
                             "select.fit=true or fit_by=least_squares")
        return self

    @model_validator(mode="after")
    def _window_needs_max(self) -> "SelectionConfig":
        if self.score_window is not None and self.aggregate != "max":
            raise ValueError(f"select.score_window needs select.aggregate=max (got {self.aggregate!r}): a windowed "
                             "mean would average each key over a different set of rows; set score_window=null")
        return self


# the first state's cap on the keys of one (layer, KV head) fitted jointly (SelectionConfig.fit_keys): on a
# 7.7k-token untuned text the uncapped fit lost to KVzip+int4 at 5 % of the bytes and the cap gained 9 points
# on probes (8.8 on a 5.3k one); on the 1.5k-token default document it costs 0.8 (99.4 → 98.6 %), where the
# refined state goes live instead (docs/quality.md, "A cap on the keys fitted jointly")
FIRST_FIT_KEYS = 1024
# the first state's score window (SelectionConfig.score_window): on an untuned 5.3k-token legal text the same
# probe figures as every batch scoring every key (97.4 % at 5 % of the bytes, 93.2 at 1 %; 96.8–99.7 % of the
# kept keys the same on a 3.7k text) for a scoring that grows with n (docs/quality.md, "Scores from the nearby
# reconstruction"); a document under 2·1,024 tokens plus a batch's span is scored exactly as without it
FIRST_SCORE_WINDOW = 1024


# the first state's key choice (SelectionConfig.key_choice): greedy where it keeps at most 5 % of the document's
# entries (0.5 % of the float32 bytes at int4 keeps ~3.5 %), top above. On the eight-document panel greedy gained
# 0 to +10 points of probe KL at 0.5 % (+2 to +6 on the withheld probes, never below) and −1.7 to +3.2 at 1 %
# (6.9 % kept), nothing from 2 % up (docs/quality.md, "Keys chosen together for the fit")
FIRST_KEY_CHOICE = "auto"
# the first state's β and values (SelectionConfig.fit_by): least squares where keys are scarce, each head's least
# squares or merge by held-out fit queries up to a quarter of the entries, merged above — merging gained +0.5 to
# +1.6 points over least squares at 5 % of the float32 bytes on all five documents measured, traded places with
# it by document at 1 % (−5.3 to +2.7) and was 10 points behind at 0.5 %; the head-by-head choice gained −0.5 to
# +7.4 over merging at 1 % on eight documents, +0.1 to +1.6 at 2 % and +0.0 to +0.1 at 5 % (for 1.3–2× the fit's
# time) on four, and lost 1.5–5.4 to least squares at 0.5 % (docs/quality.md "Merging evicted keys instead of
# fitting", "Least squares or merge, head by head")
FIRST_FIT_BY = "auto"
# the first state's selection: a ``--set first.select.KEY=VALUE`` changes KEY of THIS, not of SelectionConfig()
FIRST_SELECT = SelectionConfig(fit_queries="recon", score_queries="recon", fit_keys=FIRST_FIT_KEYS,
                               score_window=FIRST_SCORE_WINDOW, key_choice=FIRST_KEY_CHOICE, fit_by=FIRST_FIT_BY)


class RefineConfig(FrozenConfig):
    """Gradient steps after the closed-form fit (the ``recon_refine`` state method, nectar/states/recon_refine.py):
    Adam on the next-token KL between the full-context model and the model reading the state, teacher-forced on
    the document's reconstruction spans, every stored key, value and β read on its grid. 0 steps: the fit alone.
    At 0.5 % of the float32 KV's bytes 200 steps lifted seven of the eight panel documents from 66–79 % to 90–94 % (the 8.9k one to 88 %; 90 % at 400 steps) of the
    no-document KL on held-out probes, in 15–40 min on two cores (docs/quality.md, "Refined end to end on the
    reconstruction")."""

    steps: int = Field(0, ge=0)  # Adam steps, one batch of spans each (the batches cycle in a seeded order)
    lr: float = Field(1e-3, gt=0)  # Adam's rate on the float behind each stored code
    batch_tokens: int = Field(1024, gt=0)  # padded tokens a step (spans × the longest)
    topk: int = Field(64, gt=0)  # the teacher's top-K of the KL, plus the tail bucket
    # "always": the steps run whatever the budget; "auto": only where the state keeps at most 5 % of the
    # document's (layer, KV head, token) entries — keys scarce, where the fit alone left 66–79 % and the steps
    # gained 15–26 points; above it the fit (merged) is at 97–99 % and the minutes buy ~1 point
    when: Literal["always", "auto"] = added_setting("always")
    # 0: ``steps`` whatever the document's length; N: ``steps`` for every N tokens of the document when that is
    # more — the spans grow with the text, so fixed steps cover a long one less often (pydoc:types, 8.9k tokens:
    # 88.3 % [86.6, 89.8] after 200 steps, 90.3 [88.7, 91.7] after 400: docs/quality.md)
    per_tokens: int = added_setting(0, ge=0)
    # "constant": Adam at ``lr`` every step; "cosine": a linear warm-up over the first 5 % of the steps to ``lr``,
    # then a cosine decay to 0 by the last step — the same steps, the state's codes settling as the rate falls
    # (measured against "constant": docs/quality.md, "The steps' rate": no gain on GFDL-1.3 or pydoc:types)
    lr_schedule: Literal["constant", "cosine"] = added_setting("constant")


# the first state's refinement (FirstConfig.refine): 200 steps where keys are scarce (0.5 % of the float32 bytes at
# int4 keeps ~3.5 % of the entries), none above — the first state is published live from the fit first and the
# steps then replace it (docs/quality.md, "Refined end to end on the reconstruction")
FIRST_REFINE_STEPS = 200
FIRST_REFINE_PER_TOKENS = 4500  # 200 steps up to 4.5k tokens, 397 on pydoc:types' 8.9k (docs/quality.md)
FIRST_REFINE = RefineConfig(steps=FIRST_REFINE_STEPS, when="auto", per_tokens=FIRST_REFINE_PER_TOKENS)


class FirstConfig(FrozenConfig):
    """The first state (nectar/stages/first.py): keys chosen by reconstructing the document alone, the
    closed-form β and values on the reconstruction queries, no LLM server — servable before self-study
    starts; the promote stage replaces it by the refined (train) state when that is better on the run's
    held-out pairs. Its bytes are the train module's (``train.module.rho`` of the float32 document KV)."""

    enabled: bool = True
    bits: Literal[32, 8, 4, 2] = 4  # storage precision of the kept keys and values (β bf16 below 32)
    # recon_fit: ranked and fitted on the reconstruction queries only (no question exists yet)
    select: SelectionConfig = FIRST_SELECT
    # gradient steps on the fitted state, end to end on the reconstruction spans, where keys are scarce (minutes,
    # after the fit is live); in the cache key, so a first state made before this default is made again
    refine: RefineConfig = FIRST_REFINE
    seed: int = 0
    # promote: the refined state goes live when its recovered KL on the held-out pairs (test + probes,
    # pooled) beats the first state's with the paired interval of the difference above 0 at this level
    confidence: float = Field(0.95, gt=0, lt=1)

    @field_validator("select", mode="before")
    @classmethod
    def _over_first_defaults(cls, value: Any) -> Any:
        """Keys given for ``select`` (a preset's, ``--set first.select.fit_keys=…``) change the first state's
        selection, the others keep its defaults; pydantic alone would fill them from SelectionConfig()'s
        (the whole-query fit, no cap, no window)."""
        return {**FIRST_SELECT.model_dump(), **value} if isinstance(value, dict) else value

    @field_validator("refine", mode="before")
    @classmethod
    def _over_first_refine(cls, value: Any) -> Any:
        """``--set first.refine.steps=100`` changes the steps of FIRST_REFINE (still ``when: auto``), not of
        RefineConfig() (``always``)."""
        return {**FIRST_REFINE.model_dump(), **value} if isinstance(value, dict) else value


class ModuleConfig(FrozenConfig):
    arch: Literal["mlp", "quadrature"] = "mlp"
    rho: float = Field(0.02, gt=0)  # fraction of each head's KV cache (2·n·d)
    layer_multipliers: tuple[float, ...] = (1.0, 2.0, 5.0, 2.0)
    score_fraction: float = 0.1  # MLP: share of the budget for the score head
    depths: tuple[int, int, int] = (0, 4, 4)  # (D_b, D_s, D_t)
    residual: bool = False
    layer_norm: bool = False
    normalize_targets: bool = True
    # quadrature only: a log-mass bias β per (W, Z) pair (Attention Matching's state form)
    bias: bool = False
    # quadrature only: how (W, Z, β) start — the first p document rows, the p most-attended rows per
    # head (evict), those rows with fitted β and values (attention_matching), or keys chosen by
    # reconstructing the document with β and values fitted (recon_fit); see nectar.states
    init: Literal["first", "evict", "attention_matching", "recon_fit"] = "first"
    select: SelectionConfig = added_setting(SelectionConfig())  # init "recon_fit": selection and fit
    # storage precision of the module's parameters: 32 = float32; 8/4/2 = asymmetric integer codes with
    # an fp16 scale and zero per group of ``quant_group`` values (nectar/quantization.py). ρ stays a share
    # of the float32 document KV's BYTES, so a lower precision buys more pairs / a wider network.
    bits: Literal[32, 8, 4, 2] = added_setting(32)
    quant_group: int = added_setting(64, ge=4)

    @field_validator("init", mode="before")
    @classmethod
    def _renamed_init(cls, value: Any) -> Any:  # init: kvzip (old configs, run.json) is read as recon_fit
        return renamed("init", value) if isinstance(value, str) else value


# Settings that no longer exist, and why: a config that sets one is refused with this reason
# (nectar.schemas.presets.load_config); a run.json that still holds one opens as before.
REMOVED_KEYS: dict[tuple[str, ...], str] = {
    ("train", "num_workers"): "nothing read it: the targets reader streams with its own prefetch thread",
}


class TrainConfig(FrozenConfig):
    module: ModuleConfig = ModuleConfig()
    lambda_alpha: float = 0.1
    lambda_A: float = 1.0
    lambda_kl: float = 0.0
    # "mean": Lα and LA are per-element means of the σ-normalised squared errors (≈ 1 for a module
    # that predicts the targets' mean, like KL's scale), so λ values weigh the terms as the paper
    # intends; "sum": the paper's literal sum over layers, heads and d (≈ 17k at the start on
    # SmolLM2, which makes any λKL negligible). See docs/configuration.md.
    regression_scale: Literal["mean", "sum"] = "mean"
    samples: int = 1_000_000  # total sample budget (query tokens for regression, pairs for KL)
    # False: a closed-form quadrature init (attention_matching, evict, recon_fit) IS the state — saved
    # without gradient steps (a quantized recon_fit state keeps its quantization-aware fit)
    refine: bool = added_setting(True)
    # below 32 bits: gradient steps see the parameters as stored — rounded onto their grid in every
    # forward, straight-through gradient to float parameters rounded once more when saved
    # (modules/stored.py ``trained_as_stored``), so a quantization-aware fit is refined, not discarded;
    # False: trained in float, rounded after
    quant_aware: bool = added_setting(False)
    # then end-to-end steps on the module as stored: the next-token KL to the full-context model over the
    # document's reconstruction spans (the ``recon_refine`` method's steps, nectar/states/recon_refine.py);
    # a quadrature module that reads the document (init recon_fit). 0 steps: off
    end_to_end: RefineConfig = added_setting(RefineConfig())
    # the targets' splits trained on: "train", or "train+recon" with the reconstruction spans
    # (targets.recon.capture must have captured them)
    splits: Literal["train", "train+recon", "recon"] = added_setting("train")
    # Train on a nested subset: whole pairs of ``splits`` (each split in turn, its pairs in an order
    # drawn from seed) up to this many query tokens; None trains on all of them. Raising it only adds
    # pairs (training/data.py limit_query_tokens; the data curve of docs/quality.md).
    max_query_tokens: int | None = added_setting(None, ge=1)
    batch_size: int = 32
    ref_batch_size: int = 4
    peak_lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 200
    checkpoint_every: int = 200
    max_bad_steps: int = 20  # consecutive non-finite steps before the run is declared diverged
    # Token batches are drawn from windows of this many tokens, each made of randomly chosen whole
    # zarr chunks (the streaming loader reads a window chunk-aligned); part of the data order.
    shuffle_window_tokens: int = Field(4096, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _drop_removed(cls, data: Any) -> Any:
        """Run directories written before a key was removed still open (``load_config`` refuses the
        key in what a user writes; see REMOVED_KEYS)."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if ("train", k) not in REMOVED_KEYS}
        return data


class EvaluateConfig(FrozenConfig):
    splits: tuple[str, ...] = ("test", "challenge")
    max_samples: int = 500
    judge: LLMConfig = LLMConfig(temperature=0.0, max_new_tokens=256)
    top_p: float = 0.8
    temperature: float = 0.7
    max_new_tokens_qa: int = 64
    max_new_tokens_other: int = 196
    seed: int = 0
    benchmark_lengths: tuple[int, ...] = (512, 1024, 2048)
    benchmark_new_tokens: int = 32
    # Teacher-forced metrics use every pair of a split (max_samples caps the judged generations);
    # their 95 % intervals come from a paired bootstrap over pairs with this many resamples.
    bootstrap_resamples: int = Field(2000, ge=100)
    # Greedy agreement with the full-context model (exact match, ROUGE-L, embedding cosine): up to
    # this many pairs per split (0 = off), continuations of up to this many tokens.
    # Greedy decoding is the costly part of evaluation (one decode step per token per system), and
    # agreement needs the start of a continuation, not all of it.
    agreement_max_samples: int = Field(64, ge=0)
    agreement_new_tokens: int = Field(32, ge=1)
    embedder: str = "embedded:all-minilm-l6-v2"
    # The user's own questions (``--questions FILE``, JSONL; nectar/evaluation/questions.py): a
    # ``questions`` split beside test and probes. Left out of the run id and the cache key as a path:
    # the file's sha256 enters the evaluate stage's inputs instead, so adding or editing the file
    # re-runs evaluate only, in the same run directory.
    questions: str | None = resource(None)
    # Tokens of the full-context model's greedy reference answer to a question the file gives none.
    questions_answer_tokens: int = added_setting(128, ge=1)


class PipelineConfig(FrozenConfig):
    preset: str = "cpu"
    model: ModelConfig = ModelConfig()
    chunk: ChunkConfig = ChunkConfig()
    synthesize: SynthesizeConfig = SynthesizeConfig()
    verify: VerifyConfig = VerifyConfig()
    targets: TargetsConfig = TargetsConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    first: FirstConfig = added_setting(FirstConfig())
