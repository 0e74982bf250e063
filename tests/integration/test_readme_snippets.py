"""Every ```python block of README.md runs as written, on the real default model.

Each block executes in a fresh namespace, as a user pasting it into a new interpreter would. The
weights are loaded once: ``RKSCEngine.from_pretrained`` is patched to build each requested engine
(with the block's own ``EngineConfig``) around one loaded model and tokenizer, so a block that
configures ASKS or an RSBCM budget still gets exactly that engine.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rksc_engine import RKSCEngine

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def readme_snippets() -> list[tuple[str, str]]:
    """``(section heading, code)`` of every python block, in order."""
    text = README.read_text(encoding="utf-8")
    snippets = []
    for match in _BLOCK.finditer(text):
        headings = re.findall(r"^## (.+)$", text[: match.start()], re.MULTILINE)
        snippets.append((headings[-1] if headings else "top", match.group(1)))
    return snippets


SNIPPETS = readme_snippets()


def test_the_readme_has_python_snippets_and_keeps_its_opening_commands():
    assert len(SNIPPETS) >= 6, f"found {len(SNIPPETS)} python blocks in README.md"
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
        assert model_path is None, "README snippets use the embedded default model"
        return RKSCEngine(model, tokenizer, config)

    monkeypatch.setattr(RKSCEngine, "from_pretrained", staticmethod(from_pretrained))
    monkeypatch.setattr(_engines, "_shared_engines", {})  # the adapters' registry, fresh per snippet
    try:  # a snippet sets LlamaIndex's global Settings; put them back afterwards
        from llama_index.core import Settings
    except ImportError:
        return
    monkeypatch.setattr(Settings, "_llm", Settings._llm)
    monkeypatch.setattr(Settings, "_embed_model", Settings._embed_model)


@pytest.mark.parametrize("heading,code", SNIPPETS, ids=[f"{i}-{h}" for i, (h, _) in enumerate(SNIPPETS)])
def test_a_readme_snippet_runs_as_written(one_load, heading, code):
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(code, f"README.md ({heading})", "exec"), namespace)
