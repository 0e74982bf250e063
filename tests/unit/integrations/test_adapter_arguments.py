"""What the adapters do with the arguments a user brings from Hugging Face's own wrappers
(``HuggingFaceLLM``, ``HuggingFacePipeline.from_model_id``, ``ChatHuggingFace(llm=...)``): each one
is honoured or refused with what to write instead; none is dropped. On a tiny model saved to a local
directory, so loading by path runs for real and nothing is downloaded."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

import torch  # noqa: E402

from rksc_engine import RKSCEngine  # noqa: E402
from rksc_integrations._common import sampling_from_generate_kwargs  # noqa: E402
from rksc_integrations.langchain import RKSCLLM as LangChainLLM  # noqa: E402
from rksc_integrations.langchain import ChatRKSC  # noqa: E402
from rksc_integrations.llama_index import RKSCLLM  # noqa: E402
from tests.conftest import make_char_tokenizer, make_tiny_model  # noqa: E402

HUB_ID = "meta-llama/Meta-Llama-3-8B-Instruct"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model and its tokenizer saved as a Hugging Face model directory."""
    path = tmp_path_factory.mktemp("tiny-model")
    make_tiny_model(max_positions=1024).save_pretrained(path)
    make_char_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture
def engine():
    return RKSCEngine(make_tiny_model(max_positions=1024), make_char_tokenizer())


def is_tiny(engine: RKSCEngine) -> bool:
    """The engine runs the tiny model (not the 135M default): 64 hidden units, a 102-token vocabulary."""
    return engine.model.config.hidden_size == 64 and len(engine.tokenizer) == 102


# -- transformers generate() arguments, shared by both adapters ------------------------------------
@pytest.mark.parametrize(("kwargs", "settings"), [
    ({"max_new_tokens": 9}, {"max_new_tokens": 9}),
    ({"do_sample": False}, {"temperature": 0.0}),
    ({"do_sample": True}, {"temperature": 1.0, "top_k": 50}),  # transformers' sampling defaults
    ({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 0}, {"temperature": 0.7, "top_p": 0.9, "top_k": 0}),
    ({"temperature": 0.9}, {"temperature": 0.9, "top_k": 50}),  # a temperature without do_sample still samples
    ({"temperature": 0}, {"temperature": 0}),
    ({"stop_strings": "\n"}, {"stop": ["\n"]}),
])
def test_generate_kwargs_become_the_rksc_sampling_settings_they_mean(kwargs, settings):
    assert sampling_from_generate_kwargs(kwargs, "generate_kwargs") == settings


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"num_beams": 4}, TypeError, r"generate_kwargs\['num_beams'\].*no beam search"),
    ({"repetition_penalty": 1.2}, TypeError, r"repetition_penalty"),
    ({"max_length": 64}, TypeError, r"max_length.*max_new_tokens"),
    ({"do_sample": False, "temperature": 0.9}, ValueError, r"do_sample=False.*temperature"),
    ({"do_sample": True, "temperature": 0}, ValueError, r"do_sample=True with temperature=0"),
    ({"do_sample": "yes"}, TypeError, r"do_sample"),
    ("temperature=0.9", TypeError, r"must be a dict"),
])
def test_generate_kwargs_rksc_cannot_honour_are_refused_with_what_to_write(kwargs, error, match):
    with pytest.raises(error, match=match):
        sampling_from_generate_kwargs(kwargs, "generate_kwargs")


# -- LlamaIndex: HuggingFaceLLM's arguments ---------------------------------------------------------
def test_llama_index_rejects_an_unknown_argument_naming_it_and_the_close_match(engine):
    with pytest.raises(TypeError, match=r"'tempreature'.*did you mean 'temperature'"):
        RKSCLLM(engine=engine, tempreature=0.5)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'beam_width'"):
        RKSCLLM(engine=engine, beam_width=4)


def test_llama_index_loads_the_model_huggingface_llm_names_with_its_generation_settings(model_dir):
    llm = RKSCLLM(model_name=model_dir, tokenizer_name=model_dir, device_map="cpu", max_new_tokens=6,
                  generate_kwargs={"temperature": 0.9, "top_p": 0.8}, context_window=512)
    assert is_tiny(llm.engine), "model_name was not loaded"
    assert llm.engine.model.device.type == "cpu"
    assert (llm.temperature, llm.top_p, llm.top_k) == (0.9, 0.8, 50)
    assert llm.metadata.context_window == 512 and llm.metadata.num_output == 6
    response = llm.complete("hello", seed=0)
    assert 0 < response.additional_kwargs["completion_tokens"] <= 6
    greedy = RKSCLLM(model_name=model_dir, device_map="cpu", generate_kwargs={"do_sample": False})
    assert greedy.engine is llm.engine, "the same directory, device and dtype should share one engine"
    assert greedy.temperature == 0
    half = RKSCLLM(model_name=model_dir, model_kwargs={"torch_dtype": torch.float16, "device_map": "cpu"})
    assert half.engine.model.dtype == torch.float16, "model_kwargs' torch_dtype was not honoured"


@pytest.mark.parametrize(("arguments", "error", "match"), [
    ({"model_name": HUB_ID}, ValueError, r"model_name='meta-llama/.*not a local model directory.*never downloads"),
    ({"tokenizer_name": "/elsewhere"}, ValueError, r"tokenizer_name='/elsewhere' is not the model's directory"),
    ({"device_map": {"": 0}}, ValueError, r"device_map=.*spreads the model"),
    ({"device_map": "balanced"}, ValueError, r"device_map='balanced' spreads the model"),
    ({"device_map": "cpu", "device": "cpu"}, ValueError, r"device or device_map"),
    ({"generate_kwargs": {"num_beams": 2}}, TypeError, r"generate_kwargs\['num_beams'\]"),
    ({"generate_kwargs": {"max_new_tokens": 8}, "max_new_tokens": 16}, ValueError, r"max_new_tokens is given twice"),
    ({"model_kwargs": {"quantization_config": object()}}, TypeError, r"model_kwargs\['quantization_config'\]"),
    ({"model_kwargs": {"trust_remote_code": True}}, TypeError, r"EngineConfig\(trust_remote_code=True\)"),
    ({"stopping_ids": [2]}, TypeError, r"does not take stopping_ids.*stop="),
    ({"tokenizer_kwargs": {}}, TypeError, r"does not take tokenizer_kwargs"),
    ({"tokenizer": object()}, TypeError, r"does not take tokenizer.*RKSCEngine\(model, tokenizer\)"),
    ({"model": torch.nn.Linear(1, 1)}, TypeError, r"model must be a local model directory"),
    ({"context_window": 100_000}, ValueError, r"context_window=100000 exceeds the model's context window of 1024"),
])
def test_llama_index_refuses_what_rksc_cannot_honour_with_what_to_write(model_dir, arguments, error, match):
    arguments = {"model_name": model_dir, **arguments} if "model" not in arguments else arguments
    with pytest.raises(error, match=match):
        RKSCLLM(**arguments)


# -- LangChain: HuggingFacePipeline.from_model_id and ChatHuggingFace(llm=...) ---------------------
def test_from_model_id_takes_huggingface_pipelines_arguments(model_dir):
    llm = LangChainLLM.from_model_id(
        model_id=model_dir, task="text-generation", device=-1, model_kwargs={"torch_dtype": "float32"},
        pipeline_kwargs={"max_new_tokens": 5, "do_sample": True, "temperature": 0.5, "top_p": 0.9,
                         "return_full_text": False},
        seed=3,
    )
    assert is_tiny(llm.engine), "model_id was not loaded"
    assert (llm.device, llm.dtype) == ("cpu", "float32")
    assert (llm.max_new_tokens, llm.temperature, llm.top_p, llm.top_k, llm.seed) == (5, 0.5, 0.9, 50, 3)
    generation = llm.generate(["hello"]).generations[0][0]
    assert 0 < generation.generation_info["usage"]["output_tokens"] <= 5
    chat = ChatRKSC.from_model_id(model_dir, device_map="cpu", model_kwargs={"dtype": torch.float32},
                                  pipeline_kwargs={"max_new_tokens": 4})
    assert chat.engine is llm.engine and chat.max_new_tokens == 4 and chat.temperature == 0


@pytest.mark.parametrize(("arguments", "error", "match"), [
    ({"task": "summarization"}, ValueError, r"task must be 'text-generation'"),
    ({"backend": "openvino"}, ValueError, r"backend must be 'default'"),
    ({"pipeline_kwargs": {"return_full_text": True}}, ValueError, r"return_full_text.*only the new text"),
    ({"pipeline_kwargs": {"repetition_penalty": 1.1}}, TypeError, r"pipeline_kwargs\['repetition_penalty'\]"),
    ({"pipeline_kwargs": {"temperature": 0.5}, "temperature": 0.1}, ValueError, r"temperature is given twice"),
    ({"pipeline_kwargs": {"max_new_tokens": 5}, "max_tokens": 9}, ValueError, r"max_new_tokens is given twice"),
    ({"device": 0, "device_map": "auto"}, ValueError, r"device or device_map"),
    ({"model_kwargs": {"device_map": "cpu"}, "device": "cpu"}, ValueError, r"device or device_map"),
    ({"model_kwargs": {"load_in_4bit": True}}, TypeError, r"model_kwargs\['load_in_4bit'\]"),
    ({"batch_size": 4}, TypeError, r"batch_size"),
    ({"model_id": HUB_ID}, ValueError, r"model_id='meta-llama/.*not a local model directory"),
    ({"tempreature": 0.5}, ValueError, r"tempreature"),  # pydantic's extra="forbid" names it
])
def test_from_model_id_refuses_what_rksc_cannot_honour(model_dir, arguments, error, match):
    with pytest.raises(error, match=match):
        LangChainLLM.from_model_id(**{"model_id": model_dir, **arguments})


def test_chat_rksc_takes_an_rksc_llm_like_chat_huggingface_takes_a_pipeline(engine):
    llm = LangChainLLM(engine=engine, max_tokens=7, temperature=0.3, stop="x", seed=2)
    chat = ChatRKSC(llm=llm)
    assert chat.engine is engine
    assert (chat.max_new_tokens, chat.temperature, chat.stop, chat.seed) == (7, 0.3, ["x"], 2)
    assert chat.top_p == 1.0 and chat.n == 1, "settings not set on the llm keep the chat model's defaults"
    assert 0 < chat.invoke("hello").usage_metadata["output_tokens"] <= 7
    mine = ChatRKSC(llm=llm, max_tokens=3, temperature=0)
    assert (mine.max_new_tokens, mine.temperature, mine.seed) == (3, 0, 2), "the chat model's own arguments win"


def test_chat_rksc_refuses_an_llm_it_cannot_take_or_a_second_source(engine):
    with pytest.raises(TypeError, match=r"llm must be an rksc RKSCLLM.*ChatRKSC\(llm=RKSCLLM.from_model_id"):
        ChatRKSC(llm=object())
    with pytest.raises(ValueError, match="at most one of llm, engine and model"):
        ChatRKSC(llm=LangChainLLM(engine=engine), engine=engine)
