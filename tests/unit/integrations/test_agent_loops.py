"""The agent patterns docs/agents.md shows, on the tiny model: a forced first tool call, and the stop
that bounds the loop when the model would call a tool at every step (what the 135M default model does
with two tools: it repeats its first call until the recursion limit). The worst case is made certain
here by forcing every call the pattern leaves to the model, so the bound holds whatever a model does.

The LangGraph agent is built from ``StateGraph``, ``ToolNode`` and ``tools_condition`` (LangGraph's
``create_react_agent`` is deprecated in 1.x and its successor, ``langchain.agents.create_agent``,
needs the ``langchain`` package); no agent code in the repository may go back to the deprecated one.
"""

from __future__ import annotations

import asyncio
import re
import warnings
from pathlib import Path

import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import AIMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

from rksc_integrations.langchain import ChatRKSC  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
QUESTION = "What is (3 + 4) * 5?"


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


# -- LangGraph --------------------------------------------------------------------------------------
def langgraph_agent(chat: ChatRKSC, max_tool_calls: int | None, model_decides: str = "any"):
    """docs/agents.md's agent: the first call forced, then ``model_decides`` (``"auto"`` in the docs;
    ``"any"`` here plays a model that always calls), and after ``max_tool_calls`` tool results no tools
    offered, so the model answers (None: no such stop)."""
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    tools = [add, multiply]

    def call_model(state: MessagesState) -> dict:
        calls = sum(isinstance(m, ToolMessage) for m in state["messages"])
        if calls == 0:
            choice = "any"
        elif max_tool_calls is not None and calls >= max_tool_calls:
            choice = "none"
        else:
            choice = model_decides
        return {"messages": [chat.bind_tools(tools, tool_choice=choice).invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", call_model)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


@pytest.mark.parametrize("max_tool_calls", [1, 3])
def test_a_langgraph_agent_with_a_tool_call_budget_ends_within_it_even_if_the_model_always_calls(
        engine, max_tool_calls):
    pytest.importorskip("langgraph")
    from langgraph.warnings import LangGraphDeprecationWarning

    chat = ChatRKSC(engine=engine, max_tokens=8, temperature=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LangGraphDeprecationWarning)  # the agent uses no deprecated LangGraph API
        agent = langgraph_agent(chat, max_tool_calls)
        # agent, tools, ..., agent: 2 * max_tool_calls + 1 steps; LangGraph stops a run whose step count
        # reaches recursion_limit, so one more is the least limit that lets it end (docs/agents.md's).
        result = agent.invoke({"messages": [("user", QUESTION)]}, {"recursion_limit": 2 * max_tool_calls + 2})
    messages = result["messages"]
    assert sum(isinstance(m, ToolMessage) for m in messages) == max_tool_calls
    assert sum(isinstance(m, AIMessage) for m in messages) == max_tool_calls + 1
    assert messages[0].content == QUESTION
    first_call = messages[1].tool_calls
    assert len(first_call) == 1 and first_call[0]["name"] in ("add", "multiply"), "the first call was not forced"
    assert isinstance(messages[-1], AIMessage) and not messages[-1].tool_calls, "the agent did not end on an answer"


@pytest.mark.slow
def test_without_the_stop_a_langgraph_agent_whose_model_always_calls_runs_into_the_recursion_limit(engine):
    pytest.importorskip("langgraph")
    from langgraph.errors import GraphRecursionError

    chat = ChatRKSC(engine=engine, max_tokens=8, temperature=0)
    with pytest.raises(GraphRecursionError):
        langgraph_agent(chat, max_tool_calls=None).invoke({"messages": [("user", QUESTION)]}, {"recursion_limit": 9})


def test_the_forced_first_call_then_auto_lets_the_model_answer(engine):
    """The documented default, ``"auto"`` after the forced call: the tiny model writes no call, so the
    agent answers after one tool result."""
    pytest.importorskip("langgraph")
    chat = ChatRKSC(engine=engine, max_tokens=8, temperature=0)
    result = langgraph_agent(chat, max_tool_calls=2, model_decides="auto").invoke(
        {"messages": [("user", QUESTION)]}, {"recursion_limit": 6})
    messages = result["messages"]
    assert 1 <= sum(isinstance(m, ToolMessage) for m in messages) <= 2
    assert isinstance(messages[-1], AIMessage) and not messages[-1].tool_calls


# -- LlamaIndex -------------------------------------------------------------------------------------
def always_calling_llm(engine):
    """A LlamaIndex ``RKSCLLM`` that must call a tool whenever tools are offered: the model that loops."""
    from rksc_integrations.llama_index import RKSCLLM

    class AlwaysCalls(RKSCLLM):
        def _prepare_chat_with_tools(self, tools, *args, **kwargs):
            return {**super()._prepare_chat_with_tools(tools, *args, **kwargs), "tool_required": True}

    return AlwaysCalls(engine=engine, max_new_tokens=8)


def llama_index_tool_calls(agent, **run_kwargs) -> tuple[int, object]:
    from llama_index.core.agent.workflow.workflow_events import ToolCallResult

    async def run():
        handler = agent.run(QUESTION, **run_kwargs)
        calls = [event async for event in handler.stream_events() if isinstance(event, ToolCallResult)]
        return len(calls), await handler

    return asyncio.run(run())


def llama_index_tools():
    from llama_index.core.tools import FunctionTool

    return [FunctionTool.from_defaults(fn=f.func, name=f.name, description=f.description) for f in (add, multiply)]


def test_a_function_agent_with_max_iterations_and_a_generated_stop_ends_even_if_the_model_always_calls(engine):
    pytest.importorskip("llama_index.core")
    from llama_index.core.agent.workflow import FunctionAgent

    agent = FunctionAgent(tools=llama_index_tools(), llm=always_calling_llm(engine), initial_tool_choice="any",
                          early_stopping_method="generate")
    calls, output = llama_index_tool_calls(agent, max_iterations=2)
    # Iteration 1 (forced) runs its call; iteration 2's call is not run: max_iterations ends the loop
    # and one last chat, with no tools offered, writes the answer.
    assert calls == 1
    assert not output.tool_calls or all(c.tool_name in ("add", "multiply") for c in output.tool_calls)
    assert output.response.content is not None


@pytest.mark.slow
def test_without_the_stop_a_function_agent_whose_model_always_calls_runs_into_max_iterations(engine):
    pytest.importorskip("llama_index.core")
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.workflow.errors import WorkflowRuntimeError

    agent = FunctionAgent(tools=llama_index_tools(), llm=always_calling_llm(engine), initial_tool_choice="any")
    with pytest.raises(WorkflowRuntimeError, match="Max iterations of 4 reached"):
        llama_index_tool_calls(agent, max_iterations=4)


# -- no deprecated agent constructor ----------------------------------------------------------------
def test_no_agent_code_uses_langgraphs_deprecated_create_react_agent():
    """Importing or calling it prints LangGraph's deprecation warning on every run."""
    use = re.compile(r"create_react_agent\s*\(|import[^\n]*\bcreate_react_agent\b")
    places = [p for folder in ("cookbook", "docs", "tests", "rksc_integrations", "rksc_engine", "rksc_serve",
                               "rksc_cli", "rksc_bench", "benchmarks")
              for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".ipynb", ".md") and p != Path(__file__)]
    places += [REPO / "README.md"]
    offenders = [str(p.relative_to(REPO)) for p in places if p.is_file() and use.search(p.read_text(encoding="utf-8"))]
    assert not offenders, f"these use LangGraph's deprecated create_react_agent: {offenders}"
