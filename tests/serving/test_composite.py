"""Several documents at once where users ask: ``nectar serve``'s composite model ids (``a+b``) and
``nectar ask RUN_A RUN_B "…"``, over two runs' trained modules on the tiny model (tests/serving/conftest.py)."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from nectar.pipeline.cli import app as cli
from nectar.serving.app import create_app
from nectar.serving.ask import ask_composed
from nectar.serving.limits import ServeLimits
from nectar.serving.loader import open_served_run
from nectar.serving.registry import BaseModelDiffers, open_registry

Q = "Who planted the orchard, and who bought the island?"


@pytest.fixture(scope="module")
def two(served_run, second_run):
    return open_registry([open_served_run(served_run), open_served_run(second_run)], None, 2_000_000_000)


def _chat(c, model: str, n: int = 6):
    return c.post("/v1/chat/completions", json={"model": model, "max_tokens": n, "temperature": 0,
                                                "messages": [{"role": "user", "content": Q}]})


def test_composite_model_id_answers_as_nectar_ask_over_both_runs(two, served_run, second_run):
    a, b = two.names
    with TestClient(create_app(two, ServeLimits())) as c:
        cards = c.get("/v1/models").json()["data"]
        assert all("'+'" in card["nectar"]["compose"] for card in cards)  # the list says how to ask for them
        card = c.get(f"/v1/models/{a}+{b}").json()
        assert card["nectar"]["parts"] == [a, b]
        assert card["nectar"]["n_context"] == two.documents[a].n_context + two.documents[b].n_context
        r = _chat(c, f"{a}+{b}")
        assert r.status_code == 200 and r.json()["model"] == f"{a}+{b}"
        served = r.json()["choices"][0]["message"]["content"]
        swapped = _chat(c, f"{b}+{a}")
        assert swapped.status_code == 200
        missing = _chat(c, f"{a}+nowhere")
        assert missing.status_code == 404
        msg = missing.json()["error"]["message"]
        assert "'nowhere'" in msg and "join served model ids with '+'" in msg
        metrics = c.get("/metrics").text
        assert 'model="composite"' in metrics
    # the server's composite id and `nectar ask RUN_A RUN_B` are one path: the same greedy answer
    asked = ask_composed([served_run, second_run], Q, max_new_tokens=6, temperature=0.0)
    assert asked.text == served and asked.n_context == card["nectar"]["n_context"]


def test_nectar_ask_with_two_runs_streams_an_answer(served_run, second_run):
    res = CliRunner().invoke(cli, ["ask", served_run, second_run, Q, "--max-new-tokens", "4", "--temperature", "0"])
    assert res.exit_code == 0, res.output
    assert res.output == ask_composed([served_run, second_run], Q, max_new_tokens=4, temperature=0.0).text + "\n"


def test_composing_runs_of_different_base_models_is_refused_in_one_line(served_run, tmp_path):
    # by path: in a whole-suite run `conftest` names whichever conftest.py was imported first
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("serving_conftest", Path(__file__).with_name("conftest.py"))
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    DOC2, build_served_run = helpers.DOC2, helpers.build_served_run

    other = build_served_run(tmp_path, DOC2, overrides=("model.name=tiny:qwen2",))
    with pytest.raises(BaseModelDiffers, match="base model 'tiny:qwen2'.*differs") as err:
        ask_composed([served_run, other], Q, max_new_tokens=2)
    assert "\n" not in str(err.value)
    res = CliRunner().invoke(cli, ["ask", served_run, other, Q])
    assert res.exit_code != 0 and len(res.output.strip().splitlines()) == 1, res.output
