"""Tiny seeded random models of the model families users run locally, for exactness checks and
per-family measurements that need no weights.

Each family is a ``transformers`` config small enough for CI (2-4 layers, hidden size 64), with the
family's distinctive attention kept and made to bite at short lengths: sliding windows of 8-16
tokens, Gemma 2's logit soft-capping, gpt-oss's attention sinks, Gemma 3's 5:1 local:global layers,
and the recurrent layers of the hybrids. The head is scaled so greedy choices are decisive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

VOCAB_SIZE = 102  # the test suite's character tokenizer: 2 specials + string.printable
EOS_TOKEN_ID = 1
PAD_TOKEN_ID = 0
SLIDING_WINDOW = 12  # small enough that a 40-token prompt leaves most of it outside the window


@dataclass(frozen=True)
class Family:
    """One model family: its ``transformers`` model type and how to build a tiny config of it.

    Attributes:
        name: What users call it (``"gemma2"``, ``"mistral-sliding"``).
        model_type: The ``transformers`` config's model type.
        make_config: Builds the tiny config (vocabulary, special tokens and sizes filled in).
        recurrent: Whether some layers keep a recurrent state instead of per-token KV.
        attention: What is distinctive about its attention, for tables.
    """

    name: str
    model_type: str
    make_config: Callable[[], Any]
    recurrent: bool = False
    attention: str = "full"


def _common(**overrides: Any) -> dict[str, Any]:
    settings = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                    eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, bos_token_id=None,
                    tie_word_embeddings=False)
    settings.update(overrides)
    return settings


def _config(class_name: str, **overrides: Any) -> Callable[[], Any]:
    def make() -> Any:
        import transformers

        return getattr(transformers, class_name)(**_common(**overrides))
    return make


def _gpt2() -> Any:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB_SIZE, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                      eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, bos_token_id=EOS_TOKEN_ID,
                      tie_word_embeddings=False)


_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

FAMILIES: tuple[Family, ...] = (
    # The paper's four.
    Family("llama3", "llama", _config("LlamaConfig", rope_theta=500000.0)),
    Family("qwen2.5", "qwen2", _config("Qwen2Config")),
    Family("mistral", "mistral", _config("MistralConfig", sliding_window=None)),
    Family("falcon3", "llama", _config("LlamaConfig", num_hidden_layers=3, rope_theta=1000042.0)),
    # Others with full attention.
    Family("qwen3", "qwen3", _config("Qwen3Config", head_dim=16)),
    Family("qwen3-moe", "qwen3_moe", _config("Qwen3MoeConfig", head_dim=16, **_MOE)),
    Family("phi3", "phi3", _config("Phi3Config", sliding_window=None)),
    Family("olmo2", "olmo2", _config("Olmo2Config")),
    Family("granite", "granite", _config("GraniteConfig")),
    Family("gpt-neox", "gpt_neox", _config("GPTNeoXConfig", num_key_value_heads=4)),
    Family("gpt2", "gpt2", _gpt2, attention="full, learned positions"),
    Family("mixtral", "mixtral", _config("MixtralConfig", sliding_window=None, num_local_experts=4,
                                         num_experts_per_tok=2)),
    # Sliding windows, soft-capping and sinks.
    Family("mistral-sliding", "mistral", _config("MistralConfig", sliding_window=SLIDING_WINDOW),
           attention="sliding window on every layer"),
    Family("starcoder2", "starcoder2", _config("Starcoder2Config", sliding_window=SLIDING_WINDOW),
           attention="sliding window on every layer"),
    Family("gemma2", "gemma2", _config("Gemma2Config", head_dim=16, sliding_window=SLIDING_WINDOW,
                                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
           attention="sliding and full alternating, soft-capped logits"),
    Family("gemma3", "gemma3_text", _config("Gemma3TextConfig", head_dim=16, num_hidden_layers=6,
                                            sliding_window=SLIDING_WINDOW, sliding_window_pattern=6),
           attention="5 sliding : 1 full"),
    Family("gpt-oss", "gpt_oss", _config("GptOssConfig", head_dim=16, sliding_window=SLIDING_WINDOW,
                                         num_local_experts=4, num_experts_per_tok=2),
           attention="sliding and full alternating, attention sinks"),
    Family("cohere2", "cohere2", _config("Cohere2Config", num_hidden_layers=4, sliding_window=SLIDING_WINDOW),
           attention="3 sliding : 1 full"),
    # Recurrent hybrids.
    Family("lfm2", "lfm2", _config("Lfm2Config", num_hidden_layers=3, layer_types=[
        "conv", "full_attention", "conv"]), recurrent=True, attention="short convolutions + full attention"),
    Family("qwen3-next", "qwen3_next", _config("Qwen3NextConfig", head_dim=16, num_hidden_layers=4, **_MOE,
                                               linear_num_key_heads=2, linear_num_value_heads=4,
                                               linear_key_head_dim=16, linear_value_head_dim=16),
           recurrent=True, attention="gated delta net + full attention 3:1"),
    Family("falcon-h1", "falcon_h1", _config("FalconH1Config", mamba_d_ssm=64, mamba_n_heads=4,
                                             mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
                                             mamba_chunk_size=16),
           recurrent=True, attention="mamba2 + attention in parallel"),
)


def family(name: str) -> Family:
    """The family called ``name``; ``ValueError`` listing the known ones otherwise."""
    for candidate in FAMILIES:
        if candidate.name == name:
            return candidate
    raise ValueError(f"family must be one of {[f.name for f in FAMILIES]}, got {name!r}")


def char_tokenizer() -> Any:
    """The character tokenizer these models are sized for: ``<pad>`` (0), ``<eos>`` (1), then one
    token per character of ``string.printable`` (``VOCAB_SIZE`` in all), no chat template."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>"] + list(string.printable))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def make_family_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A tiny seeded random causal LM of family ``name`` (eager attention, eval mode)."""
    from transformers import AutoModelForCausalLM

    config = family(name).make_config()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    # Random init gives near-uniform logits; scale the head so greedy choices are decisive and
    # sampled branches differ.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = EOS_TOKEN_ID
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model
