"""A LangGraph tool-calling agent (a model node and a ``ToolNode``, looped by ``tools_condition``) with
ChatRKSC and a calculator tool, end to end on the real default model; every step after the first is
served from the prefix cache. No deprecated LangGraph API is used (its warnings are errors here)."""

from __future__ import annotations

import pytest

pytest.importorskip("langgraph.prebuilt")
pytest.importorskip("langgraph.warnings")

from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.messages import AIMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langgraph.graph import START, MessagesState, StateGraph  # noqa: E402
from langgraph.prebuilt import ToolNode, tools_condition  # noqa: E402

from rksc_integrations.langchain import ChatRKSC  # noqa: E402
from tests.conftest import evaluate_arithmetic  # noqa: E402

pytestmark = [pytest.mark.integration,
              pytest.mark.filterwarnings("error::langgraph.warnings.LangGraphDeprecationWarning")]


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses, e.g. "12 * 7"."""
    return evaluate_arithmetic(expression)


class StepRecorder(BaseCallbackHandler):
    def __init__(self):
        self.usage = []

    def on_llm_end(self, response, **kwargs):
        self.usage.append(response.generations[0][0].message.usage_metadata)


def test_a_tool_calling_agent_calls_the_calculator_answers_and_reuses_the_cached_prompt_each_step():
    chat = ChatRKSC(max_tokens=32, temperature=0)

    def call_model(state: MessagesState) -> dict:
        # The first step must use the tool (a 135M model rarely starts a call unprompted); later
        # steps leave the choice to the model, with the same tools offered, so the prompt prefix
        # is the previous step's prompt and comes from the cache.
        used_tool = any(isinstance(m, ToolMessage) for m in state["messages"])
        model = chat.bind_tools([calculator], tool_choice=None if used_tool else "calculator")
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", call_model)
    graph.add_node("tools", ToolNode([calculator]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    agent = graph.compile()
    recorder = StepRecorder()
    result = agent.invoke(
        {"messages": [("user", "What is 12 * 7? Use the calculator.")]},
        config={"callbacks": [recorder], "recursion_limit": 12},
    )
    messages = result["messages"]
    tool_results = [m for m in messages if isinstance(m, ToolMessage)]
    assert tool_results and not tool_results[0].content.startswith("error")
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls and final.content.strip()
    assert len(recorder.usage) >= 2
    for previous, step in zip(recorder.usage, recorder.usage[1:]):
        # Each prompt extends the previous one, so at least that prompt is reused.
        assert step["input_token_details"]["cache_read"] >= previous["input_tokens"] - 1 > 0
