"""RoPE scaling reaches the model config on every load path (pretrained directory and tiny
in-process models), keeps the model's own rope_theta (transformers 5 keeps it inside
``rope_parameters``; replacing that dict crashed YaRN), and rotates exactly as a config.json
written the documented way would."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config

from nectar.base_model import ModelLoadError, apply_rope_scaling, load_base_model
from nectar.schemas import ModelConfig
from nectar.schemas.presets import ConfigError, load_config


PAPER_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}  # paper §4.1


def _rotary(base):
    return base.model.model.rotary_emb


def test_yarn_factor_reaches_the_config_and_keeps_rope_theta(tiny_llama, tiny_llama_yarn):
    params = tiny_llama_yarn.model.config.rope_parameters
    assert params["rope_type"] == "yarn" and params["factor"] == 2.0
    assert params["rope_theta"] == tiny_llama.model.config.rope_parameters["rope_theta"]
    assert params["original_max_position_embeddings"] == 4096
    assert tiny_llama_yarn.max_context_tokens == tiny_llama_yarn.model.config.max_position_embeddings == 8192
    assert tiny_llama.max_context_tokens == 4096
    # the rotation itself changed: YaRN's interpolated frequencies and its attention factor
    assert not torch.allclose(_rotary(tiny_llama_yarn).inv_freq, _rotary(tiny_llama).inv_freq)
    assert _rotary(tiny_llama_yarn).attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(2.0)).item() + 1)
    assert tiny_llama_yarn.weights_hash != tiny_llama.weights_hash  # cached artifacts never mix the two


def test_scaled_rotation_equals_the_documented_config_json_way(tiny_qwen3_yarn):
    """What Qwen documents for long inputs: rope_scaling in config.json. Same frequencies, same factor."""
    ref = Qwen3Config(**{**tiny_qwen3_yarn.model.config.to_dict(), "rope_scaling": dict(PAPER_YARN),
                         "max_position_embeddings": 4096})
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    ref_rotary = Qwen3RotaryEmbedding(ref)
    ours = _rotary(tiny_qwen3_yarn)
    assert torch.equal(ours.inv_freq, ref_rotary.inv_freq)
    assert ours.attention_scaling == ref_rotary.attention_scaling
    assert tiny_qwen3_yarn.max_context_tokens == 4 * 32768


def test_pretrained_directory_with_yarn_factor_loads(tmp_path, tiny_llama):
    """The path that crashed (AutoConfig + from_pretrained, as for SmolLM2 and hub models)."""
    cfg = LlamaConfig(**{**tiny_llama.model.config.to_dict(), "rope_parameters": {"rope_theta": 12345.0,
                                                                                   "rope_type": "default"}})
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tiny_llama.tokenizer.save_pretrained(tmp_path)
    base = load_base_model(ModelConfig(name=str(tmp_path), device="cpu", yarn_factor=3.0))
    params = base.model.config.rope_parameters
    assert params["rope_theta"] == 12345.0 and params["rope_type"] == "yarn" and params["factor"] == 3.0
    assert base.max_context_tokens == 3 * 4096
    with torch.no_grad():
        assert torch.isfinite(base.model(torch.tensor([[1, 2, 3]])).logits).all()


def test_smollm2_window_doubles_with_yarn_factor_2(tmp_path):
    """The issue's crash, on the embedded model's own config (no weights needed)."""
    from transformers import AutoConfig

    from nectar.base_model import embedded_smollm2_dir

    cfg = AutoConfig.from_pretrained(embedded_smollm2_dir())
    theta = cfg.rope_parameters["rope_theta"]
    apply_rope_scaling(cfg, {"rope_type": "yarn", "factor": 2.0})
    assert cfg.rope_parameters["rope_theta"] == theta and cfg.max_position_embeddings == 16384
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)  # raised TypeError (None ** Tensor) before
    assert torch.isfinite(inv_freq).all() and factor > 1


def test_paper_preset_scales_qwen3_past_32k():
    cfg = load_config("paper", overrides=["model.name=Qwen/Qwen3-1.7B"])
    assert cfg.model.rope_scaling == PAPER_YARN
    # Qwen3-1.7B's own config: 40,960 positions, rope_theta 1e6, trained on 32,768
    hf = Qwen3Config(max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    apply_rope_scaling(hf, cfg.model.rope_scaling)
    assert hf.max_position_embeddings == 131072 and hf.rope_parameters["rope_theta"] == 1e6
    assert load_config("paper", overrides=["model.rope_scaling=null"]).model.rope_scaling is None


def test_bad_rope_settings_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="not both"):
        load_config("tiny", overrides=["model.yarn_factor=2", "model.rope_scaling={rope_type: yarn, factor: 2}"])
    with pytest.raises(ConfigError, match="'dynamic' is not supported.*yarn"):
        load_config("tiny", overrides=["model.rope_scaling={rope_type: dynamic, factor: 2}"])
    with pytest.raises(ConfigError, match="factor must be a number >= 1"):
        load_config("tiny", overrides=["model.rope_scaling={rope_type: yarn}"])
    with pytest.raises(ModelLoadError, match="low_freq_factor"):
        load_base_model(ModelConfig(name="tiny:llama", device="cpu",
                                    rope_scaling={"rope_type": "llama3", "factor": 2.0}))
