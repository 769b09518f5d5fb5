"""The system registry, trained systems' configurations, and the comparison row schema."""
import pytest

from nectar.states import METHODS
from nectar.comparison import SYSTEMS, System, register, resolve, trained_config
from nectar.schemas import ComparisonRow, ConfigError, load_config
from nectar.tables import ArtifactError, read_table, write_table


def test_registry_holds_the_issue_systems_once_each():
    quantized = [f"{b}@int{bits}" for bits in (8, 4) for b in ("truncate", "evict", "attention_matching", "matching")]
    recon_quantized = [f"{b}@int{bits}" for bits in (8, 4)
                       for b in ("recon_fit", "recon_select", "recon_fit_qa", "recon_fit_float")]
    assert list(SYSTEMS) == ["none", "full", "regression", "mixed", "distill", "cartridges", "matching", "recon_fit_regime", "truncate",
                             "evict", "attention_matching", "attention_matching_kv", "recon_select", "recon_select_layer",
                             "recon_select_mean", "recon_fit", "recon_fit_layer", "recon_fit_recon",
                             "recon_fit_nosink", "recon_fit_template", "recon_fit_qa", "recon_train", "recon_train_recon",
                             "recon_distill", *quantized, *recon_quantized, "recon_first@int4", "recon_first_fit@int4", "recon_first_top@int4", "recon_first_allkeys@int4", "recon_first_allscores@int4", "recon_first@int8", "recon_first_gptq@int4", "recon_first_greedy@int4", "recon_first_refined@int4", "recon_first_merged@int4", "recon_first_lsq@int4", "recon_first_chosen@int4", "recon_first_fitmerged@int4", "recon_mixed",
                                 "recon_train_qa@int4", "recon_train_qa_fast@int4", "recon_train_qa_float@int4", "recon_distill_qa@int4",
                             "attention_matching_kv@int8", "attention_matching_kv@int4",
                             "vllm:trained", "vllm:attention_matching_kv@int8", "vllm:attention_matching_kv@int4"]
    assert {s.name for s in SYSTEMS.values() if s.kind == "reference"} == {"none", "full"}
    for s in SYSTEMS.values():
        name, _, precision = s.name.partition("@")
        assert s.bits == (int(precision.removeprefix("int")) if precision and s.kind == "method" else 32)
        if s.kind == "trained":  # a regime's own system (at a precision), or recon_fit's state refined under one
            module = s.overlay.get("train", {}).get("module", {})
            assert s.regime in (name, "recon_fit") or module["init"] == "recon_fit"
            assert module.get("bits", 32) == (int(precision[3:]) if precision else 32)
        if s.kind == "method":
            assert s.method in METHODS  # a state method of the registry
    # default: every system this checkout can run, but the ablations and the opt-in quantized trained
    # ones (a training each)
    assert [s.name for s in resolve(None)] == [n for n in SYSTEMS if not n.startswith(("matching@", "attention_matching_kv@", "vllm:"))
                                               and n != "recon_fit_regime" and (n in ("recon_select", "recon_fit", "recon_fit@int8", "recon_fit@int4", "recon_fit_qa@int4")
        or not n.startswith("recon"))]
    assert [s.name for s in resolve(["evict", "none"])] == ["none", "evict"]  # registry order
    with pytest.raises(ConfigError, match="unknown system 'x'"):
        resolve(["x"])
    with pytest.raises(ValueError, match="already registered"):
        register(System("none", "reference", "again"))
    with pytest.raises(ValueError, match="needs a regime or an overlay"):
        System("bare", "trained", "no settings")
    with pytest.raises(ValueError, match="unknown regime"):
        System("typo", "trained", "", regime="regresion")
    with pytest.raises(ValueError, match="needs the name of its state method"):
        System("b", "method", "")


def test_a_trained_system_is_the_preset_regime_whatever_the_run_used():
    mixed_run = load_config("cpu", regime="mixed")
    reg = trained_config(mixed_run, SYSTEMS["regression"], 0.05)
    assert reg.train == load_config("cpu", regime="regression").train  # not the mixed run's 240-pair budget and lr
    default = load_config("cpu")  # the cpu preset's default: the recon_fit regime (int4, no gradient steps)
    assert trained_config(mixed_run, SYSTEMS["recon_fit_regime"], 0.05).train == default.train
    assert trained_config(mixed_run, SYSTEMS["mixed"], 0.05).train == mixed_run.train
    cart = trained_config(default, SYSTEMS["cartridges"], 0.02)
    assert cart.train.module.arch == "quadrature" and cart.train.module.rho == 0.02
    assert cart.train.lambda_kl == 1.0 and cart.train.samples == 240
    assert cart.evaluate == default.evaluate and cart.targets == default.targets  # only training differs
    # settings no regime touches stay the run's
    deep = load_config("cpu", overrides=["train.module.depths=[0,2,2]", "train.seed=3"])
    d = trained_config(deep, SYSTEMS["distill"], 0.05).train
    assert d.module.depths == (0, 2, 2) and d.seed == 3 and d.lambda_alpha == 0.0
    with pytest.raises(ValueError, match="not trained"):
        trained_config(default, SYSTEMS["evict"], 0.05)


def test_one_entry_adds_a_system_and_its_settings_are_reset_for_the_others():
    s = register(System("wide", "trained", "a wider score head", regime="regression",
                        overlay={"train": {"module": {"score_fraction": 0.3}}}))
    try:
        base = load_config("cpu")
        assert trained_config(base, s, 0.05).train.module.score_fraction == 0.3
        # a run made with that setting does not leak it into the other systems
        wide_run = load_config("cpu", overrides=["train.module.score_fraction=0.3"])
        assert trained_config(wide_run, SYSTEMS["regression"], 0.05).train.module.score_fraction == 0.1
        assert "wide" in [x.name for x in resolve(None)]
    finally:
        del SYSTEMS["wide"]


def test_each_row_kind_says_what_the_row_is(monkeypatch):
    """The kind column: reference (none, full), method (a state method of nectar/states fitted by compare:
    the outside baselines and the product's own recon_fit family alike), trained, kvpress, run (the
    run's own states) — never "baseline" for the project's own methods, in a compare of one run or a
    composed one."""
    from types import SimpleNamespace

    from nectar.comparison import compose
    from nectar.comparison.systems import kvpress_systems, run_states

    kinds = {name: s.kind for name, s in SYSTEMS.items()}
    assert {n for n, k in kinds.items() if k == "reference"} == {"none", "full"}
    for name in ("truncate", "evict", "attention_matching", "attention_matching_kv@int4", "recon_select",
                 "recon_fit", "recon_fit@int4", "recon_fit_qa@int4", "recon_first@int4", "recon_mixed"):
        assert kinds[name] == "method", name
    assert {n for n, k in kinds.items() if k == "served"} == {"vllm:trained", "vllm:attention_matching_kv@int8",
                                                             "vllm:attention_matching_kv@int4"}
    assert set(kinds.values()) == {"reference", "trained", "method", "served"}
    assert [(s.name, s.kind) for s in run_states({"first", "train"})] == [("run:first", "run"),
                                                                          ("run:refined", "run")]
    assert {s.kind for s in kvpress_systems("kvpress:knorm:int4")} == {"kvpress"}
    # a System registered under the old name of the kind (code written before the rename) is a method
    assert System("keep_last", "baseline", "exact KV of the last tokens", method="keep_last").kind == "method"
    # the composed compare labels each composed / alone row by its system's kind, not a fixed "baseline"
    monkeypatch.setattr(compose, "fit_part", lambda part, s, rho, *a, **k: compose.State(object(), 10, 1.0, "quadrature"))
    monkeypatch.setattr(compose, "compose", lambda states, lengths, pos, model, at, prefix=None: (object(), None))
    parts = [SimpleNamespace(label=x, layout=SimpleNamespace(n=5)) for x in ("a", "b")]
    entries = compose.composed_entries(parts, SYSTEMS["recon_fit@int4"], 0.1, ["concat"],
                                       SimpleNamespace(model=None), 10, lambda m: None)
    assert [e.kind for e in entries] == ["method"] * 3  # composed under concat, then each document alone


def test_comparison_rows_round_trip_and_validate(tmp_path):
    row = ComparisonRow(system="evict", kind="method", rho=0.05, state_bytes=3_500_000, split="probes",
                        n_pairs=51, n_tokens=1445, kl_to_full=0.4, kl_ci_low=0.35, kl_ci_high=0.46,
                        recovered_kl=0.17, recovered_kl_ci_low=0.14, recovered_kl_ci_high=0.2, token_acc=0.5,
                        token_acc_ci_low=0.45, token_acc_ci_high=0.55, agreement_rouge_l=0.3, train_seconds=2.5)
    ref = ComparisonRow(system="none", kind="reference", state_bytes=0, split="probes", n_pairs=51, n_tokens=1445,
                        kl_to_full=2.1, recovered_kl=0.0)
    url = str(tmp_path / "comparison.parquet")
    write_table(url, [row, ref], ComparisonRow)
    back = read_table(url, ComparisonRow)
    assert back == [row, ref] and back[1].rho is None and back[1].agreement_rouge_l is None
    with pytest.raises(ArtifactError, match="kind"):
        write_table(url, [{**row.model_dump(), "kind": "magic"}], ComparisonRow)
    with pytest.raises(Exception, match="system"):
        ComparisonRow(kind="baseline", state_bytes=1, split="test", n_pairs=1, n_tokens=1, kl_to_full=0.1)


def test_a_quantized_trained_system_is_the_same_regime_stored_at_its_bits():
    run = load_config("cpu")
    q4 = trained_config(run, SYSTEMS["matching@int4"], 0.05)
    f32 = trained_config(run, SYSTEMS["matching"], 0.05)
    assert q4.train.module.bits == 4 and f32.train.module.bits == 32
    assert q4.train.model_copy(update={"module": q4.train.module.model_copy(update={"bits": 32})}) == f32.train
    assert "bits" not in f32.train.module.cache_dict()  # float32 runs keep the fingerprints they had
