"""The train stage as the pipeline calls it: outputs and spec, input checks, and resuming after a
real SIGKILL of the training process."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parents[1] / "training"))
from targets_fixture import DOC, make_targets  # noqa: E402

from nectar.modules.io import load_module, read_spec  # noqa: E402
from nectar.schemas.artifacts import TrainLogRow  # noqa: E402
from nectar.schemas.config import ModuleConfig, TrainConfig  # noqa: E402
from nectar.stages.train import TRAIN_OUTPUTS, train  # noqa: E402
from nectar.training.fit import TrainInputError  # noqa: E402
from nectar.tables import read_table  # noqa: E402
from nectar.targets.reader import TargetsData  # noqa: E402
from nectar.training.data import subset_pairs  # noqa: E402

CFG = TrainConfig(samples=96, batch_size=16, eval_every=3, checkpoint_every=3, peak_lr=3e-3,
                  module=ModuleConfig(rho=0.25, depths=(0, 2, 2)))


@pytest.fixture(scope="module")
def targets(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("stage-targets")
    layout, kv, sha = make_targets(tiny_llama, DOC, out)
    return str(out), layout, kv, sha


def test_stage_writes_module_spec_and_log(tiny_llama, targets, tmp_path):
    url, layout, kv, sha = targets
    counts = train(url, CFG, tiny_llama, None, str(tmp_path))
    assert all((tmp_path / name).exists() for name in TRAIN_OUTPUTS)
    spec = read_spec(str(tmp_path))
    assert spec.doc_sha256 == sha and spec.n_context == layout.n and spec.base_model_hash == tiny_llama.weights_hash
    assert spec.kv_cache_bytes == 2 * layout.n * 16 * 2 * 2 * 4  # 2·n·d·L·Hkv float32 entries
    assert spec.n_params == 2 * sum(spec.per_layer_params)  # two KV heads per layer
    assert counts["kv_over_module"] == pytest.approx(spec.kv_cache_bytes / spec.module_bytes, rel=1e-2)
    module, _ = load_module(str(tmp_path), tiny_llama, sha)
    assert module.n_params() == spec.n_params
    rows = read_table(str(tmp_path / "train_log.parquet"), TrainLogRow)
    assert {r.split for r in rows} == {"train", "heldout"} and rows[-1].step == counts["steps"] == 6


def test_quadrature_needs_the_document_kv(tiny_llama, targets, tmp_path):
    cfg = CFG.model_copy(update={"module": ModuleConfig(arch="quadrature", rho=0.25)})
    with pytest.raises(TrainInputError, match="doc_kv"):
        train(targets[0], cfg, tiny_llama, None, str(tmp_path))
    counts = train(targets[0], cfg.model_copy(update={"samples": 32}), tiny_llama, targets[2], str(tmp_path))
    assert counts["steps"] == 2


def test_a_quantized_state_trains_in_float_and_is_stored_and_loaded_on_its_grid(tiny_llama, targets, tmp_path):
    """train.module.bits = 4: more pairs in the bytes, trained in float, saved as int4 codes (the file's
    tensor bytes are the spec's module_bytes) and loaded back to values on the int4 grid."""
    from nectar.modules.stored import stored_nbytes
    from nectar.quantization import fake_quantize

    cfg = CFG.model_copy(update={"samples": 32, "module": ModuleConfig(arch="quadrature", rho=0.1, bias=True,
                                                                       init="attention_matching", bits=4)})
    train(targets[0], cfg, tiny_llama, targets[2], str(tmp_path))
    spec = read_spec(str(tmp_path))
    f32 = ModuleConfig(arch="quadrature", rho=0.1, bias=True)
    assert spec.module_config["bits"] == 4 and spec.module_config["quad_pairs"][0] > 0.1 * targets[1].n
    module, _ = load_module(str(tmp_path), tiny_llama, targets[3])
    assert spec.module_bytes == stored_nbytes(module) <= 0.1 * spec.kv_cache_bytes
    assert sum(t.numel() * t.element_size() for t in load_file(str(tmp_path / "module.safetensors")).values()) \
        == spec.module_bytes
    W = module.layers[0].W.detach()
    assert torch.equal(fake_quantize(W, 4), W) and f32.bits == 32


def test_targets_of_another_model_are_refused(tiny_qwen3, targets, tmp_path):
    with pytest.raises(TrainInputError, match="weights hash"):
        train(targets[0], CFG, tiny_qwen3, None, str(tmp_path))


_CHILD = """
import sys, time, torch
torch.set_num_threads(2)  # as the parent (tests/conftest.py): same kernels, same bits
from nectar.base_model import load_base_model
from nectar.schemas import ModelConfig
from nectar.schemas.config import TrainConfig
from nectar.stages.train import train
cfg = TrainConfig.model_validate_json(sys.argv[3])
base = load_base_model(ModelConfig(name="tiny:llama"))
print("started", flush=True)
train(sys.argv[1], cfg, base, None, sys.argv[2], progress=lambda done, total: time.sleep(0.15))
"""


@pytest.mark.slow
def test_resume_after_sigkill_reaches_the_uninterrupted_result(tiny_llama, targets, tmp_path):
    cfg = CFG.model_copy(update={"samples": 640, "eval_every": 5, "checkpoint_every": 5})  # 40 steps
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, targets[0], str(killed), cfg.model_dump_json()],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ckpt = killed / "checkpoints" / "last.pt"
    deadline = time.time() + 240
    while time.time() < deadline:  # wait for a mid-run checkpoint, then kill without warning
        if ckpt.exists() and torch.load(ckpt, weights_only=False)["state"]["step"] >= 15:
            break
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "module.safetensors").exists()
    counts = train(targets[0], cfg, tiny_llama, None, str(killed))
    assert 15 <= counts["resumed_from_step"] < 40
    train(targets[0], cfg, tiny_llama, None, str(tmp_path / "straight"))
    a, b = load_file(str(killed / "module.safetensors")), load_file(str(tmp_path / "straight" / "module.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra = read_table(str(killed / "train_log.parquet"), TrainLogRow)
    rb = read_table(str(tmp_path / "straight" / "train_log.parquet"), TrainLogRow)
    assert ra == rb
    assert counts["train_loss"] == [r for r in rb if r.split == "train"][-1].loss


def test_recon_fit_init_trains_the_selected_state_and_saves_only_its_real_pairs(tiny_llama, targets, tmp_path):
    from nectar.attention.exact import ExactDocState
    from nectar.modules.provider import ModuleDocState
    from nectar.schemas.config import ProbesConfig, ReconConfig
    from nectar.queries.recon import make_recon

    url, layout, kv, sha = targets
    spans = [(s.instruction, s.response)
             for s in make_recon(DOC, ReconConfig(span_words=12, withheld_fraction=0.0), ProbesConfig(block_units=1))]
    cfg = CFG.model_copy(update={"samples": 32, "module": ModuleConfig(arch="quadrature", rho=0.25, bias=True,
                                                                      init="recon_fit")})
    with pytest.raises(TrainInputError, match="reconstruction spans"):
        train(url, cfg, tiny_llama, kv, str(tmp_path))
    counts = train(url, cfg, tiny_llama, kv, str(tmp_path), document=DOC, spans=spans)
    spec = read_spec(str(tmp_path))
    counts_per_head = spec.module_config["quad_head_pairs"]
    d, budgets = tiny_llama.head_dim, spec.module_config["budgets"]
    assert sum(map(sum, counts_per_head)) == tiny_llama.num_kv_heads * sum(budgets) // (2 * d + 1)
    assert spec.n_params == sum(map(sum, counts_per_head)) * (2 * d + 1)  # masked slots hold nothing
    assert counts["steps"] == 2
    module, _ = load_module(str(tmp_path), tiny_llama, sha)  # loads back as trained (padded widths)
    q = torch.randn(1, tiny_llama.num_q_heads, 3, d) * 3
    st = ModuleDocState(module)(0, q, tiny_llama.scaling)
    assert torch.isfinite(st.out).all() and st.lse.shape == ExactDocState(kv)(0, q, tiny_llama.scaling).lse.shape


def test_recon_fit_int4_state_without_refinement_is_the_quantized_fit_saved_as_codes(tiny_llama, targets, tmp_path):
    """train.refine=false: the train stage saves recon_fit's quantization-aware fit as the state (no
    gradient steps); its file holds the counted bytes and loads back to the fitted baseline exactly."""
    from nectar.states import fit_recon
    from nectar.layout import build_layout
    from nectar.modules.builder import plan_from_config
    from nectar.schemas.config import ProbesConfig, ReconConfig
    from nectar.queries.recon import make_recon

    url, layout, kv, sha = targets
    spans = [(s.instruction, s.response)
             for s in make_recon(DOC, ReconConfig(span_words=12, withheld_fraction=0.0), ProbesConfig(block_units=1))]
    mcfg = ModuleConfig(arch="quadrature", rho=0.05, bias=True, init="recon_fit", bits=4)
    cfg = CFG.model_copy(update={"refine": False, "module": mcfg})
    counts = train(url, cfg, tiny_llama, kv, str(tmp_path), document=DOC, spans=spans)
    assert counts["steps"] == 0 and counts["refined"] is False
    spec = read_spec(str(tmp_path))
    file_bytes = sum(t.numel() * t.element_size() for t in load_file(str(tmp_path / "module.safetensors")).values())
    assert spec.module_bytes == file_bytes == counts["module_bytes"]
    assert any(k.endswith(".codes") for k in load_file(str(tmp_path / "module.safetensors")))
    module, _ = load_module(str(tmp_path), tiny_llama, sha)
    plan = plan_from_config(mcfg, tiny_llama.num_layers, tiny_llama.num_kv_heads, tiny_llama.head_dim, layout.n,
                            tiny_llama.scaling)
    ref = fit_recon(tiny_llama, build_layout(tiny_llama.tokenizer, DOC), DOC, kv, url, plan, mcfg.select, spans)
    for a, b in zip(module.layers, ref.module.layers):
        assert torch.equal(a.W.cpu(), b.W) and torch.equal(a.Z.cpu(), b.Z) and torch.equal(a.beta.cpu(), b.beta)
    with pytest.raises(TrainInputError, match="refine=false"):
        train(url, CFG.model_copy(update={"refine": False}), tiny_llama, kv, str(tmp_path / "mlp"))


def test_end_to_end_steps_refine_the_closed_form_state_in_its_bytes(tiny_llama, targets, tmp_path):
    """train.end_to_end: recon_refine's steps on the train stage's closed-form state, reported in its counts and
    its progress bar; the saved state keeps the fit's bytes and codes. Asked of a state that is not a
    reconstruction-fitted quadrature, one line says what to set, before any work."""
    from nectar.schemas.config import ProbesConfig, ReconConfig, RefineConfig
    from nectar.queries.recon import make_recon

    url, layout, kv, sha = targets
    spans = [(s.instruction, s.response)
             for s in make_recon(DOC, ReconConfig(span_words=12, withheld_fraction=0.0), ProbesConfig(block_units=1))]
    mcfg = ModuleConfig(arch="quadrature", rho=0.05, bias=True, init="recon_fit", bits=4)
    plain = train(url, CFG.model_copy(update={"refine": False, "module": mcfg}), tiny_llama, kv, str(tmp_path / "fit"),
                  document=DOC, spans=spans)
    assert "refine_s" not in plain
    cfg = CFG.model_copy(update={"refine": False, "module": mcfg,
                                 "end_to_end": RefineConfig(steps=2, batch_tokens=512, topk=16)})
    seen = []
    counts = train(url, cfg, tiny_llama, kv, str(tmp_path / "e2e"), document=DOC, spans=spans,
                   progress=lambda done, total: seen.append((done, total)))
    assert counts["refine_s"] > 0 and {"span_kl_fit", "span_kl_refined"} <= set(counts)
    assert seen[-1] == (2, 2) and counts["module_bytes"] == plain["module_bytes"]
    assert any(k.endswith(".codes") for k in load_file(str(tmp_path / "e2e" / "module.safetensors")))
    load_module(str(tmp_path / "e2e"), tiny_llama, sha)
    with pytest.raises(TrainInputError, match="train.end_to_end"):
        train(url, CFG.model_copy(update={"end_to_end": RefineConfig(steps=2)}), tiny_llama, kv, str(tmp_path / "mlp"),
              document=DOC, spans=spans)


def test_recon_fit_int4_state_refined_as_stored_keeps_its_grid_and_moves_off_the_fit(tiny_llama, targets, tmp_path):
    """train.quant_aware: the int4 recon_fit fit refined by gradient steps that see it as stored; the saved
    state is on its grid (codes in the file), starts where the fit is (same step-0 held-out row) and
    differs from it after the steps."""
    from nectar.quantization import fake_quantize
    from nectar.schemas.config import ProbesConfig, ReconConfig
    from nectar.queries.recon import make_recon

    url, layout, kv, sha = targets
    spans = [(s.instruction, s.response)
             for s in make_recon(DOC, ReconConfig(span_words=12, withheld_fraction=0.0), ProbesConfig(block_units=1))]
    mcfg = ModuleConfig(arch="quadrature", rho=0.05, bias=True, init="recon_fit", bits=4)
    fit_only = CFG.model_copy(update={"refine": False, "module": mcfg})
    train(url, fit_only, tiny_llama, kv, str(tmp_path / "fit"), document=DOC, spans=spans)
    qat = CFG.model_copy(update={"quant_aware": True, "samples": 64, "peak_lr": 3e-2, "module": mcfg})
    counts = train(url, qat, tiny_llama, kv, str(tmp_path / "qat"), document=DOC, spans=spans)
    assert counts["steps"] == 4
    assert any(k.endswith(".codes") for k in load_file(str(tmp_path / "qat" / "module.safetensors")))
    fitted, _ = load_module(str(tmp_path / "fit"), tiny_llama, sha)
    trained, _ = load_module(str(tmp_path / "qat"), tiny_llama, sha)
    moved = 0
    for a, b in zip(trained.layers, fitted.layers):
        for name in ("W", "Z"):
            x = getattr(a, name).detach().cpu()
            assert torch.equal(fake_quantize(x, 4), x)  # on the int4 grid, as stored
            moved += int((x != getattr(b, name).detach().cpu()).sum())
    assert moved > 0


def test_quant_aware_changes_nothing_at_32_bits(tiny_llama, targets, tmp_path):
    url, layout, kv, sha = targets
    cfg = CFG.model_copy(update={"samples": 32, "module": ModuleConfig(arch="quadrature", rho=0.1, bias=True,
                                                                       init="attention_matching")})
    a = train(url, cfg, tiny_llama, kv, str(tmp_path / "float"))
    b = train(url, cfg.model_copy(update={"quant_aware": True}), tiny_llama, kv, str(tmp_path / "qat"))
    assert a["train_loss"] == b["train_loss"] and a["heldout_loss"] == b["heldout_loss"]
    ma, _ = load_module(str(tmp_path / "float"), tiny_llama, sha)
    mb, _ = load_module(str(tmp_path / "qat"), tiny_llama, sha)
    for (n, p), (_, r) in zip(ma.named_parameters(), mb.named_parameters()):
        assert torch.equal(p, r), n


def test_max_query_tokens_trains_on_the_nested_subset_only(tiny_llama, targets, tmp_path):
    # the data curve's points: the count of query tokens trained on is the subset's, a module differs
    # from the one trained on everything, and the setting is out of the cache key at its default
    url, *_ = targets
    data = TargetsData(f"{url}/targets.zarr")
    everything = data.pair_tokens(data.pairs("train"))
    cfg = CFG.model_copy(update={"max_query_tokens": everything // 2})
    counts = train(url, cfg, tiny_llama, None, str(tmp_path / "half"))
    assert counts["train_query_tokens"] == data.pair_tokens(subset_pairs(data, "train", everything // 2, 0))
    assert 0 < counts["train_query_tokens"] <= everything // 2
    full = train(url, CFG, tiny_llama, None, str(tmp_path / "all"))
    assert full["train_query_tokens"] == everything
    a = load_file(str(tmp_path / "half" / "module.safetensors"))
    b = load_file(str(tmp_path / "all" / "module.safetensors"))
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert "max_query_tokens" not in CFG.cache_dict() and cfg.cache_dict()["max_query_tokens"] == everything // 2
