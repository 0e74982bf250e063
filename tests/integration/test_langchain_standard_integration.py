"""LangChain's standard integration suite for ChatRKSC, on the real default model (CPU).

Features are declared through the suite's properties; checks that fail only because a 135M model
answers badly are marked xfail through the suite's own mechanism (a decorated override), each with
the reason.
"""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_tests")

from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402

from rksc_integrations.langchain import ChatRKSC  # noqa: E402

# The suite has async tests and relies on pytest-asyncio; they need its marker here, since the
# project runs pytest-asyncio in strict mode (pyproject sets no asyncio_mode).
pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio,
    pytest.mark.filterwarnings("ignore:.*is marked with '@pytest.mark.asyncio' but it is not an async function"),
]


class TestChatRKSCIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatRKSC]:
        return ChatRKSC

    @property
    def chat_model_params(self) -> dict:
        # Greedy and short: the suite makes ~60 calls, and 2 CPU cores must finish them in minutes.
        return {"max_tokens": 24, "temperature": 0}

    @property
    def standard_chat_model_params(self) -> dict:
        params = super().standard_chat_model_params
        params["max_tokens"] = 24  # the suite's default of 100 would triple the run time on CPU
        return params

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return False  # the weights are the engine's; a per-call model name cannot swap them

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False):
        # The same prompt twice: the second is served from the engine's prefix cache.
        model = self.chat_model_class(**self.chat_model_params)
        prompt = "Name three colours of the rainbow."
        model.invoke(prompt)
        if stream:
            full = None
            for chunk in model.stream(prompt):
                full = chunk if full is None else full + chunk
            message = full
        else:
            message = model.invoke(prompt)
        assert message.usage_metadata["input_token_details"]["cache_read"] > 0
        return message

    @pytest.mark.xfail(reason="SmolLM2-135M answers the weather question in prose instead of starting a tool call "
                       "when the tool choice is left to it (auto); forced calls pass in test_tool_calling/test_tool_choice")
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)  # as the suite's test
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)
