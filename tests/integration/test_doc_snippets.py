"""Every ```python block of README.md and of the pages under docs/ runs as written, on the real default model.

Each block executes in a fresh namespace, as a user pasting it into a new interpreter would. The
weights are loaded once: ``RKSCEngine.from_pretrained`` is patched to build each requested engine
(with the block's own ``EngineConfig``) around one loaded model and tokenizer, so a block that
configures ASKS or an RSBCM budget still gets exactly that engine. A block the tests cannot run (it
needs a running server) is tagged ```text instead, and is not collected here.
"""

from __future__ import annotations

import pytest

from rksc_engine import RKSCEngine
from tests.markdown_docs import ROOT, documentation_files, python_snippets

pytestmark = pytest.mark.integration

README = ROOT / "README.md"
SNIPPETS = [snippet for page in documentation_files() for snippet in python_snippets(page)]


def test_the_docs_have_python_snippets_and_the_readme_keeps_its_opening_commands():
    pages = {snippet.path.relative_to(ROOT).as_posix() for snippet in SNIPPETS}
    assert len(SNIPPETS) >= 10, f"found {len(SNIPPETS)} python blocks in {sorted(pages)}"
    assert "README.md" in pages, "the README shows no runnable python block"
    opening = README.read_text(encoding="utf-8").split("```")[1]
    assert opening.startswith("bash\n./dev ask ") and "./dev test" in opening, "the first two commands changed"


@pytest.fixture(scope="module")
def loaded_weights():
    engine = RKSCEngine.from_pretrained(progress=False)
    return engine.model, engine.tokenizer


@pytest.fixture
def one_load(monkeypatch, loaded_weights):
    """``RKSCEngine.from_pretrained()`` of the default model without reloading its weights."""
    from rksc_integrations import _engines

    model, tokenizer = loaded_weights

    def from_pretrained(model_path=None, *, device="auto", dtype="auto", config=None, progress=True):
        assert model_path is None, "documentation snippets use the embedded default model"
        return RKSCEngine(model, tokenizer, config)

    monkeypatch.setattr(RKSCEngine, "from_pretrained", staticmethod(from_pretrained))
    monkeypatch.setattr(_engines, "_shared_engines", {})  # the adapters' registry, fresh per snippet
    try:  # a snippet sets LlamaIndex's global Settings; put them back afterwards
        from llama_index.core import Settings
    except ImportError:
        return
    monkeypatch.setattr(Settings, "_llm", Settings._llm)
    monkeypatch.setattr(Settings, "_embed_model", Settings._embed_model)


@pytest.mark.parametrize(
    "snippet", SNIPPETS, ids=[f"{s.path.relative_to(ROOT).as_posix()}:{s.line}-{s.heading}" for s in SNIPPETS]
)
def test_a_documentation_snippet_runs_as_written(one_load, snippet):
    namespace: dict = {"__name__": "__doc_snippet__"}
    where = f"{snippet.path.relative_to(ROOT).as_posix()}:{snippet.line} ({snippet.heading})"
    exec(compile("\n" * snippet.line + snippet.code, where, "exec"), namespace)
