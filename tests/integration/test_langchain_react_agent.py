"""A text ReAct agent built the way LangChain users build one with an LLM (not a chat model):
a ``PromptTemplate`` with a scratchpad, ``RKSCLLM`` with ``stop=["\\nObservation:"]``, a calculator,
and a loop that parses ``Action Input`` / ``Final Answer``. On the real default model, every step
after the first is served from the prefix cache: each step's prompt is the previous prompt plus the
previous completion (whose KV the engine also cached) plus the observation.

Decoding is greedy, so the run is deterministic. The first step is forced (the scratchpad already
says ``Action: calculator`` and the model writes only the expression), because SmolLM2-135M does not
start a ReAct action reliably on its own; after the observation it writes the final answer itself.
"""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")

from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.prompts import PromptTemplate  # noqa: E402

from rksc_integrations.langchain import CACHE_EVENT, RKSCLLM, RKSCEventCollector  # noqa: E402
from tests.conftest import evaluate_arithmetic  # noqa: E402

pytestmark = pytest.mark.integration

REACT_PROMPT = """Answer the question. You can use this tool:

calculator: evaluates an arithmetic expression such as 3 * (4 + 5).

Use this format:

Question: the question to answer
Thought: what to do next
Action: calculator
Action Input: the expression to evaluate
Observation: the result of the action
Thought: I now know the final answer
Final Answer: the answer to the question

Begin!

Question: {question}
{agent_scratchpad}"""
FORCED_FIRST_STEP = "Thought: I should use the calculator.\nAction: calculator\nAction Input:"


def calculator(expression: str) -> str:
    return evaluate_arithmetic(expression.strip().strip('"'))


class UsageRecorder(BaseCallbackHandler):
    def __init__(self):
        self.usage = []

    def on_llm_end(self, response, **kwargs):
        self.usage.append(response.generations[0][0].generation_info["usage"])


def run_react(question: str, max_steps: int = 4):
    llm = RKSCLLM(max_tokens=48, temperature=0)
    agent_step = PromptTemplate.from_template(REACT_PROMPT) | llm.bind(stop=["\nObservation:"])
    recorder, collector = UsageRecorder(), RKSCEventCollector(names=[CACHE_EVENT])
    scratchpad, observations, final = FORCED_FIRST_STEP, [], None
    for _ in range(max_steps):
        text = agent_step.invoke({"question": question, "agent_scratchpad": scratchpad},
                                 config={"callbacks": [recorder, collector]})
        if "Final Answer:" in text:
            final = text.split("Final Answer:", 1)[1].strip().splitlines()[0].strip()
            break
        step = scratchpad + text
        action_input = step.rsplit("Action Input:", 1)[1].strip().splitlines()[0] if "Action Input:" in step else ""
        observations.append(calculator(action_input))
        scratchpad = f"{step}\nObservation: {observations[-1]}\nThought:"
    return final, observations, recorder.usage, collector.data(CACHE_EVENT)


def test_a_text_react_agent_uses_the_calculator_answers_and_reuses_the_cached_prompt_every_step():
    final, observations, usage, cache_events = run_react("What is 12 * 7?")
    assert observations[:1] == ["84"], f"the forced first step should evaluate 12 * 7, got {observations}"
    assert final is not None and "84" in final, f"the agent should answer 84 after the observation, got {final!r}"
    assert len(usage) >= 2
    assert usage[0]["input_token_details"]["cache_read"] < usage[0]["input_tokens"]
    for previous, step in zip(usage, usage[1:]):
        # The step's prompt extends the previous prompt, so at least that prompt comes from the cache
        # (one token of slack: BPE may re-split the boundary).
        assert step["input_token_details"]["cache_read"] >= previous["input_tokens"] - 1 > 0, usage
    # The same figures reach callbacks as rksc custom events, one per step.
    assert [e["num_cached_tokens"] for e in cache_events] == [u["input_token_details"]["cache_read"] for u in usage]
