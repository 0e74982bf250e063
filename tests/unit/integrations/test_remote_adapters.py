"""Reasoning over a server wherever rksc is reached: LangChain's ``MultiBranchReasoner`` built on an
OpenAI client model (``ChatOpenAI(base_url=...)``) or on a ``RemoteEngine``, LlamaIndex's
``RKSCBranchQueryEngine`` driving an ``RKSCLLM`` on a ``RemoteEngine``; against ``rksc serve`` on the
tiny model (in process). The local engine on the same model is the reference. (``rksc ask --server``:
``tests/unit/cli/test_cli_ask_server.py``.)"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("langchain_openai")
pytest.importorskip("llama_index.core")

from langchain_openai import ChatOpenAI  # noqa: E402
from llama_index.core.query_engine import CustomQueryEngine  # noqa: E402

from rksc_engine import CGEEConfig, RemoteEngine, SamplingParams  # noqa: E402
from rksc_integrations.langchain import MultiBranchReasoner  # noqa: E402
from rksc_integrations.llama_index import RKSCLLM, RKSCBranchQueryEngine  # noqa: E402
from rksc_serve.app import create_app  # noqa: E402
from tests.conftest import make_tiny_engine, serving  # noqa: E402

QUESTION = "What is 2 + 3?"


def first_char(text: str) -> str | None:
    return text[:1] or None


@pytest.fixture(scope="module")
def engine():
    """One engine for the module: its server is started once."""
    return make_tiny_engine()


@pytest.fixture(scope="module")
def base_url(engine):
    with serving(create_app(engine, max_tokens_limit=4096)) as url:
        yield f"{url}/v1"


def test_a_reasoner_on_chat_openai_reasons_over_its_server_as_the_local_engine(engine, base_url):
    llm = ChatOpenAI(base_url=base_url, model="rksc", api_key="unused", temperature=0.8, max_tokens=30, seed=3)
    reasoner = MultiBranchReasoner(llm=llm, n=4, answer_extractor=first_char, stop=["<none>"])
    assert isinstance(reasoner.engine, RemoteEngine) and reasoner.engine.base_url == base_url
    output = reasoner.invoke(QUESTION)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=30, seed=3, stop=("<none>",))
    local = engine.reason(QUESTION, n=4, params=params, answer_extractor=first_char)
    assert output.answer == local.answer
    assert output.cache.num_prompt_tokens == local.completions[0].num_prompt_tokens > 0, "the server's count"
    assert output.result.server_limits == ()
    assert MultiBranchReasoner(llm=llm).engine is reasoner.engine, "one RemoteEngine per server in the process"


def test_a_reasoner_on_a_remote_engine_reports_early_stop_and_the_cgee_level(base_url):
    with RemoteEngine(base_url, model="rksc") as remote, pytest.warns(UserWarning, match="decodes greedily"):
        reasoner = MultiBranchReasoner(engine=remote, n=3, temperature=0.0, max_tokens=20, answer_extractor=first_char)
        output = reasoner.invoke(QUESTION)
    assert output.early_stop is not None and output.early_stop["branches_launched"] == 3
    assert output.result.cgee_levels == (1,) and output.cgee.skipped


def test_an_unknown_llm_is_refused_naming_what_is_accepted():
    with pytest.raises(TypeError, match="OpenAI client model"):
        MultiBranchReasoner(llm=object())


class AskLLM(CustomQueryEngine):
    """The smallest query engine: the query string straight to the LLM."""

    llm: Any

    def custom_query(self, query_str: str) -> str:
        return str(self.llm.complete(query_str))


def test_the_branch_query_engine_runs_a_remote_llms_branches_under_early_stop(engine, base_url):
    settings = {"max_new_tokens": 24, "branches": 6, "temperature": 0.5, "seed": 2, "answer_key": first_char,
                "verifier": None, "cgee": CGEEConfig.off(), "vote": "exact"}
    with RemoteEngine(base_url, model="rksc") as remote:
        llm = RKSCLLM(engine=remote, **settings)
        assert llm.metadata.is_chat_model and not llm.metadata.is_function_calling_model
        response = RKSCBranchQueryEngine(AskLLM(llm=llm)).query("pick one")
    final = response.metadata["rksc"]["final"]
    assert final["num_branches"] == 6 and final["early_stop"]["branches_launched"] == 6
    local = RKSCBranchQueryEngine(AskLLM(llm=RKSCLLM(engine=engine, **settings))).query("pick one")
    assert final["answer"] == local.metadata["rksc"]["final"]["answer"], "decided never changes the vote's winner"


def test_a_remote_llm_refuses_tools_and_chunk_reuse(base_url):
    with RemoteEngine(base_url, model="rksc") as remote:
        with pytest.raises(ValueError, match="reuse_retrieved_context"):
            RKSCLLM(engine=remote, reuse_retrieved_context=True)
        llm = RKSCLLM(engine=remote)
        from llama_index.core.llms import ChatMessage

        with pytest.raises(NotImplementedError, match="local RKSCEngine"):
            llm.chat([ChatMessage(role="user", content="hi")], tools=[{"type": "function", "function": {"name": "f"}}])
