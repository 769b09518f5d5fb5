"""cache_kwargs names the KV-cache argument each transformers declares, across the rename to ``cache``."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaModel

from nectar.cache_call import cache_kwargs

CACHE_CALL_PY = Path(__file__).resolve().parents[1] / "nectar" / "cache_call.py"
KVPRESS_PY = Path.home() / ".cache" / "nectar" / "kvpress-venv" / "bin" / "python"

SCRIPT = f"""
import importlib.util, warnings, torch
from transformers import DynamicCache, LlamaConfig, LlamaModel
spec = importlib.util.spec_from_file_location("cc", {str(CACHE_CALL_PY)!r})
cc = importlib.util.module_from_spec(spec); spec.loader.exec_module(cc)
torch.manual_seed(0)
m = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1)).eval()
cache = DynamicCache()
with warnings.catch_warnings():
    warnings.simplefilter("error")
    m(input_ids=torch.tensor([[1, 2, 3]]), **cc.cache_kwargs(m, cache), use_cache=True)
print(list(cc.cache_kwargs(m, cache)), cache.get_seq_length())
"""


def _tiny_llama() -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)).eval()


def test_the_cache_is_filled_through_the_declared_argument_without_a_deprecation_warning(recwarn):
    model, cache = _tiny_llama(), DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), **cache_kwargs(model, cache), use_cache=True)
    assert cache.get_seq_length() == 3
    assert not [w for w in recwarn if "past_key_values" in str(w.message)]


@pytest.mark.slow
@pytest.mark.skipif(not KVPRESS_PY.exists(), reason="the kvpress venv (transformers 5.2) is not built here")
def test_the_same_call_fills_the_cache_under_the_kvpress_venvs_older_transformers():
    out = subprocess.run([str(KVPRESS_PY), "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["['past_key_values']", "3"]
