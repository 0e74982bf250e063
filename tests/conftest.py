"""Shared fixtures: tiny seeded random Llama-style models with a character-level tokenizer.

They run in milliseconds on CPU and exercise every code path the real model does (GQA, RoPE,
chat templates, EOS), so exactness can be checked token for token against plain transformers.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import operator
import string

import pytest
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


# Hand-built KV for radix-cache tests, in the cache's layout (L, 2, H_kv, T, D).
RADIX_LAYERS, RADIX_KV_HEADS, RADIX_HEAD_DIM = 2, 2, 4
RADIX_BYTES_PER_TOKEN = RADIX_LAYERS * 2 * RADIX_KV_HEADS * RADIX_HEAD_DIM * 4  # float32


def radix_kv(token_ids):
    """KV whose values encode (token id, position), so slices can be checked exactly."""
    t = torch.zeros(RADIX_LAYERS, 2, RADIX_KV_HEADS, len(token_ids), RADIX_HEAD_DIM)
    for pos, tok in enumerate(token_ids):
        t[:, :, :, pos, 0] = tok
        t[:, :, :, pos, 1] = pos
    return t


async def loop_turns_while_engine_held(engine, awaitable, turns: int = 50) -> tuple[object, bool]:
    """Await ``awaitable`` while another thread holds ``engine`` (``exclusive()``), so it cannot
    finish yet; meanwhile this coroutine takes ``turns`` turns of the event loop, then lets go of the
    engine. Returns ``(result, loop_was_free)``: whether those turns all ran before the engine was
    released. A call that blocks the loop thread on the engine stops every other coroutine until the
    holder gives up (after 60 s), so it reads False. Order decides, not time."""
    import threading

    held, release = threading.Event(), threading.Event()

    def hold():
        with engine.exclusive():
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(60), "the holder thread never got the engine"
    task = asyncio.ensure_future(awaitable)
    try:
        for _ in range(turns):
            await asyncio.sleep(0)
        loop_was_free = not release.is_set() and not task.done()
    finally:
        release.set()
    result = await task
    holder.join(60)
    return result, loop_was_free


def make_char_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>"]
    chars = list(string.printable)
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_byte_tokenizer(tokenizer_class=None):
    """A byte-level BPE tokenizer without merges (one token per UTF-8 byte, as a GPT-2-style
    vocabulary spells any text), with ``<pad>``/``<eos>`` and the tiny chat template; 258 ids, so
    use ``make_tiny_model(vocab_size=258)``. ``tokenizer_class``: a subclass of
    ``PreTrainedTokenizerFast`` to build (one that watches its calls, say)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = (tokenizer_class or PreTrainedTokenizerFast)(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny_model(seed: int = 0, vocab_size: int = 102, num_layers: int = 2, max_positions: int = 512):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        eos_token_id=1, pad_token_id=0, bos_token_id=None, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    # Random init gives near-uniform logits; scale the head so greedy choices are decisive and
    # sampled branches actually differ.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return model


class CountingHooks:
    """Counts forward calls per decoder layer."""

    def __init__(self, layers):
        self.calls = [0] * len(layers)
        self.handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(layers)]

    def _hook(self, i):
        def hook(*_):
            self.calls[i] += 1
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


# Prompts of very different lengths, for checks that batching and packing change no request's tokens.
MIXED_LENGTH_PROMPTS = [
    "The quick brown fox jumps over",
    "Q: what is 2+3?\nA:",
    "x",
    "A much longer prompt, repeated. " * 6,
    "Another one",
]


def assert_same_work(stats, other) -> None:
    """Two runs' ``EngineStats`` count the same prefill and cache work (field by field)."""
    for field in ("prefills", "prompt_tokens_computed", "prompt_tokens_reused", "cache_hits", "cache_misses"):
        assert getattr(stats, field) == getattr(other, field), field


def engine_hf_greedy(engine, prompt, max_new_tokens):
    """What ``transformers`` greedy ``generate`` decodes after ``prompt`` on ``engine``'s model.

    Holds the engine while it runs: the scheduler's thread switches the model's attention
    implementation for its own forwards, so a ``generate`` racing a step could run through it."""
    ids = torch.tensor([engine.encode(prompt)])
    with engine.exclusive(), torch.no_grad():
        out = engine.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False)
    return tuple(out[0, ids.shape[1]:].tolist())


@pytest.fixture
def tiny_tokenizer():
    return make_char_tokenizer()


@pytest.fixture
def tiny_model():
    return make_tiny_model()


@pytest.fixture
def tiny_engine(tiny_model, tiny_tokenizer):
    from rksc_engine import RKSCEngine

    return RKSCEngine(tiny_model, tiny_tokenizer)


def make_tiny_engine(config=None, *, max_positions: int = 4096):
    """The tiny model and the character tokenizer in an ``RKSCEngine`` (``config``: an ``EngineConfig``
    or None), its context window long enough for few-shot and chat prompts."""
    from rksc_engine import RKSCEngine

    return RKSCEngine(make_tiny_model(max_positions=max_positions), make_char_tokenizer(), config)


@pytest.fixture
def engine():
    """A fresh ``make_tiny_engine()`` per test, its cache and counters empty. ``tests/unit/serve``
    overrides it with one engine per module, which that module's servers are started on."""
    return make_tiny_engine()


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items):
    """A test on the real default model (``integration``) is in the slow tier too, so ``-m "not slow"``
    is the fast tier and ``-m slow`` the rest, however else a test is marked."""
    for item in items:
        if item.get_closest_marker("integration") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


_ARITHMETIC_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate_arithmetic(expression: str) -> str:
    """The agent tests' calculator: + - * / and parentheses, or ``"error: ..."`` (never raises)."""

    def evaluate(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC_OPS:
            return _ARITHMETIC_OPS[type(node.op)](evaluate(node.left), evaluate(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        raise ValueError(f"not arithmetic: {expression!r}")

    try:
        return str(evaluate(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


def serving(app, timeout_s: float = 10.0):
    """Serve the ASGI ``app`` with uvicorn on a free loopback port (picked now, by binding port 0) in
    a background thread; yields the base URL (``http://127.0.0.1:PORT``) and stops the server after."""
    from rksc_bench.servers import app_in_thread

    return app_in_thread(app, timeout_s)


def no_locked_nodes(engine) -> bool:
    """Whether no node of ``engine``'s radix cache is locked (every request that read one let go)."""
    stack = [engine.prefix_cache.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node is not engine.prefix_cache.root and node.lock_ref:
            return False
    return True


def run_out_of_memory_in_a_decode(engine, monkeypatch, nth: int) -> None:
    """Make the ``nth`` decode forward that runs while two or more requests run fail, once, with
    ``ForwardOutOfMemoryError`` (out of memory after every retry)."""
    from rksc_engine.kvcache.memory import ForwardOutOfMemoryError

    real_forward = engine.runner.forward
    decodes = {"n": 0}

    def forward(input_ids, cache, **kwargs):
        if input_ids.shape[1] == 1 and "logits_to_keep" not in kwargs and engine.stats().running_requests >= 2:
            decodes["n"] += 1
            if decodes["n"] == nth:
                raise ForwardOutOfMemoryError(f"injected: out of memory in decode {nth}")
        return real_forward(input_ids, cache, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", forward)


def wait_until(condition, timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    """Poll ``condition()`` until it is true (returns True) or ``timeout_s`` passes (returns False)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


class AttentionModuleStub(torch.nn.Module):
    """What the shared-prefix attention function reads from a transformers attention module."""

    def __init__(self, num_key_value_groups: int):
        super().__init__()
        self.layer_idx = 0
        self.num_key_value_groups = num_key_value_groups


def batched_attention_step(requests, group, pool=None, **attention_kwargs):
    """One decode step's attention for ``requests``, each ``(rows, prefix segments, (suffix keys,
    suffix values), (new keys, new values), query)``, in one ``BatchDecodeCache``; returns the
    output (B, 1, H, D). With ``pool`` (a ``SuffixPool``), the requests' suffixes are its slots.
    ``attention_kwargs`` are what a model passes (``sliding_window``, ...)."""
    from rksc_engine.kvcache.batch_decode import BatchDecodeCache
    from rksc_engine.kvcache.shared_prefix import SharedPrefixCache, shared_prefix_attention

    caches = []
    for rows, segments, (suffix_k, suffix_v), _, _ in requests:
        cache = SharedPrefixCache.from_segments([list(segments)], rows, suffix_capacity=8)
        cache.layers[0].update(suffix_k, suffix_v)
        if pool is not None:
            assert pool.adopt(cache)
        caches.append(cache)
    batch = BatchDecodeCache(caches)
    new_k = torch.cat([new[0] for *_, new, _ in requests])
    new_v = torch.cat([new[1] for *_, new, _ in requests])
    query = torch.cat([q for *_, q in requests])
    keys, values = batch.layers[0].update(new_k, new_v)
    out, _ = shared_prefix_attention(AttentionModuleStub(group), query, keys, values, None,
                                     scaling=query.shape[-1] ** -0.5, **attention_kwargs, **batch.forward_kwargs())
    return out


@pytest.fixture
def one_thread():
    """PyTorch's fused CPU attention kernel gives a (row, head) pair bits that depend on which thread
    of the pool computes it (the calling thread and a worker differ by an ULP once a row has about 15
    keys), and which thread that is depends on the rows around it. A test of the merge's own
    operations pins one thread; tokens across batches are measured by benchmarks/batch_invariance.py."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def save_tiny_model(directory, sample_when_asked: bool = True):
    """Save the tiny model and its tokenizer to ``directory`` (``save_pretrained``), for a server
    that loads a model directory. ``transformers serve`` samples only when the model's generation
    config says ``do_sample`` (a request's temperature alone does not switch it on), so the saved
    config says it where ``sample_when_asked``; temperature 0 still decodes greedily there."""
    model = make_tiny_model(max_positions=4096)
    model.generation_config.do_sample = sample_when_asked
    model.save_pretrained(directory)
    make_char_tokenizer().save_pretrained(directory)
    return directory


@contextlib.contextmanager
def transformers_serving(model_dir, timeout_s: float = 240.0):
    """Run ``transformers serve MODEL_DIR`` (the CLI installed with transformers) offline on a free
    loopback port; yields the base URL (``http://127.0.0.1:PORT``) once ``/v1/models`` answers, and
    stops the process after. Skips when the CLI or its serving extras are missing."""
    import os
    import socket
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    import httpx

    exe = Path(sys.executable).with_name("transformers")
    if not exe.exists():
        pytest.skip("the transformers CLI is not installed beside this Python")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    log = tempfile.TemporaryFile()
    process = subprocess.Popen([str(exe), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                                "--device", "cpu", "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                               env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"transformers serve exited ({process.returncode}): {log.read()[-2000:]!r}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("transformers serve did not answer /v1/models in time")
            time.sleep(0.25)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)
        log.close()
