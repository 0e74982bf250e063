"""``rksc ask --server URL``: the same reasoning over an OpenAI-compatible server, against ``rksc
serve`` on the tiny model (in process) and ``transformers serve`` (a subprocess, slow); the local
engine on the same model is the reference. Local-model flags with ``--server`` are refused."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from rksc_cli.ask import main as ask_main  # noqa: E402
from rksc_engine import SamplingParams  # noqa: E402
from rksc_serve.app import create_app  # noqa: E402
from tests.conftest import make_tiny_engine, save_tiny_model, serving, transformers_serving  # noqa: E402

QUESTION = "What is 2 + 3?"


@pytest.fixture(scope="module")
def engine():
    """One engine for the module: its server is started once."""
    return make_tiny_engine()


@pytest.fixture(scope="module")
def base_url(engine):
    with serving(create_app(engine, max_tokens_limit=4096)) as url:
        yield f"{url}/v1"


def ask_json(args: list[str], capsys) -> dict:
    assert ask_main(["ask", QUESTION, "--shots", "0", "--branches", "3", "--max-new-tokens", "16", "--temperature",
                     "0", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_rksc_ask_with_server_answers_as_the_local_engine(engine, base_url, capsys):
    served = ask_json(["--server", base_url, "--server-model", "rksc"], capsys)
    local = engine.reason(QUESTION, n=3, prompt=[{"role": "system", "content": _system_prompt()},
                                                 {"role": "user", "content": QUESTION}],
                          params=SamplingParams(max_new_tokens=16, top_p=0.95, seed=0, stop=("<|im_end|>",)))
    assert served["answer"] == local.answer
    assert served["server_limits"] == []
    assert [b["text"] for b in served["branches"]] == [b.text for b in local.branches]
    assert served["cgee_levels"] == [1], "over a server only CGEE level 1 runs"
    prompts = served["prompt_tokens"]
    assert prompts["requests"] >= 3 and prompts["computed"] + prompts["reused"] >= 3 * local.completions[0].num_prompt_tokens, \
        "every branch is a request that reads the prompt: the server's totals, not one prefill forked"


def test_rksc_ask_with_server_prints_what_the_server_counted(base_url, capsys):
    assert ask_main(["ask", QUESTION, "--shots", "0", "--branches", "2", "--max-new-tokens", "8",
                     "--server", base_url]) == 0
    out = capsys.readouterr().out
    assert "Prompt tokens (the server's usage):" in out and "Branches' prompt:" not in out, out


def test_rksc_ask_refuses_local_model_flags_with_server(base_url, capsys):
    assert ask_main(["ask", QUESTION, "--server", base_url, "--model", "/somewhere"]) == 2
    assert "--model" in capsys.readouterr().err


@pytest.mark.slow
def test_rksc_ask_over_transformers_serve_names_what_the_server_lacks(engine, tmp_path, capsys):
    with transformers_serving(save_tiny_model(tmp_path / "tiny")) as url:
        served = ask_json(["--server", f"{url}/v1"], capsys)
    assert any("no log-probs" in line for line in served["server_limits"])
    greedy = engine.generate([{"role": "system", "content": _system_prompt()}, {"role": "user", "content": QUESTION}],
                             SamplingParams(max_new_tokens=16, stop=("<|im_end|>",)))
    assert {b["text"] for b in served["branches"] if b["voted"]} <= {greedy.text}


def _system_prompt() -> str:
    from rksc_engine.reasoning.few_shot import SYSTEM_PROMPT

    return SYSTEM_PROMPT
