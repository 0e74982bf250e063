"""LangChain's standard unit suite for ChatRKSC, on the tiny seeded model."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_tests")

from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from rksc_engine import RKSCEngine  # noqa: E402
from rksc_integrations.langchain import ChatRKSC  # noqa: E402
from tests.conftest import make_char_tokenizer, make_tiny_model  # noqa: E402

# One engine for the suite: the suite builds a model per test (and many in test_init_time).
# A 4096-position window, since the character tokenizer makes a tool offer hundreds of tokens long.
_ENGINE = RKSCEngine(make_tiny_model(max_positions=4096), make_char_tokenizer())


class TestChatRKSCUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatRKSC]:
        return ChatRKSC

    @property
    def chat_model_params(self) -> dict:
        return {"engine": _ENGINE}

    @property
    def standard_chat_model_params(self) -> dict:
        # The unit suite adds api_key="test" for hosted providers; a local model has no key, and
        # ChatRKSC rejects unknown constructor arguments rather than ignore them.
        params = super().standard_chat_model_params
        params.pop("api_key", None)
        return params

    @property
    def supports_model_override(self) -> bool:
        return False  # the model is the engine's; a per-call model name cannot swap its weights
