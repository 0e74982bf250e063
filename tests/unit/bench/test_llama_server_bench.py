"""llama.cpp's server as an engine of ``benchmarks/remote_early_stop.py``: the flags that enable it
(and refuse it without a binary), the ``llama-server`` command line and context size, the subprocess
that is started, waited for and stopped however its block ends (``rksc_bench.servers.server_process``,
driven here by a stand-in server script), and what is read from a running server: its decode count
from ``/metrics`` once idle, and whether it prompts the model as rksc does (fake endpoints on loopback)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from rksc_bench import servers
from rksc_bench.servers import (
    LLAMA_SAMPLERS,
    ServerFailed,
    app_in_thread,
    llama_server,
    llama_server_command,
    llama_server_ctx_size,
    llama_server_decode_tokens,
    llama_server_prompt_difference,
    parse_llama_metrics,
    server_process,
)

ROOT = Path(__file__).resolve().parents[3]
LLAMA = "llama.cpp server"

# A stand-in for a server binary: records its argv and pid, answers /health 503 for its first
# NOT_READY requests (a model loading), then 200.
FAKE_SERVER = textwrap.dedent("""\
    #!{python}
    import http.server, json, os, sys
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    record = os.environ["FAKE_SERVER_RECORD"]
    not_ready = int(os.environ.get("FAKE_SERVER_NOT_READY", "2"))
    answers = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status = 503 if len(answers) < not_ready else 200
            answers.append(status)
            with open(record, "w") as f:
                json.dump({{"argv": argv, "pid": os.getpid(), "answers": answers}}, f)
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    print("fake server starting", flush=True)
    if os.environ.get("FAKE_SERVER_FAIL"):
        print("error: cannot load model", flush=True)
        sys.exit(3)
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
""")


def load_script():
    spec = importlib.util.spec_from_file_location("remote_early_stop_bench", ROOT / "benchmarks" / "remote_early_stop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load_script()


@pytest.fixture
def fake_binary(tmp_path):
    path = tmp_path / "llama-server"
    path.write_text(FAKE_SERVER.format(python=sys.executable))
    path.chmod(0o755)
    return path


@pytest.fixture
def record(tmp_path, monkeypatch):
    path = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_SERVER_RECORD", str(path))
    return path


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# -- flags ------------------------------------------------------------------------------------------
def test_naming_the_llama_cpp_engine_without_its_binary_is_a_parser_error(bench, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--servers", f"local,{LLAMA}"])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert f"--servers names '{LLAMA}', which needs --llama-server PATH" in error, error


def test_an_unknown_engine_is_a_parser_error_listing_the_engines(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--servers", "local,llama.cpp"])
    error = capsys.readouterr().err
    assert "unknown engine(s) ['llama.cpp']" in error and LLAMA in error, error


def test_the_llama_cpp_engine_runs_by_default_only_when_its_binary_is_given(bench, fake_binary):
    assert bench.parse_args([]).servers == ["local", "rksc serve", "transformers serve"]
    args = bench.parse_args(["--llama-server", str(fake_binary)])
    assert args.servers == ["local", "rksc serve", "transformers serve", LLAMA]
    assert args.llama_server == fake_binary and args.llama_server_parallel == 8
    assert bench.parse_args(["--llama-server", str(fake_binary), "--servers", LLAMA]).servers == [LLAMA]
    assert bench.parse_args(["--llama-server", str(fake_binary), "--llama-server-parallel", "4"]).llama_server_parallel == 4


def test_a_binary_that_is_not_an_executable_file_or_another_model_is_a_parser_error(bench, tmp_path, fake_binary, capsys):
    plain = tmp_path / "not-executable"
    plain.write_text("")
    for argv, expected in ((["--llama-server", str(plain)], "is not an executable file"),
                           (["--llama-server", str(tmp_path / "missing")], "is not an executable file"),
                           (["--llama-server", str(fake_binary), "--model", str(tmp_path)], "leave out --model"),
                           (["--llama-server", str(fake_binary), "--llama-server-parallel", "0"], "must be >= 1")):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        error = capsys.readouterr().err
        assert expected in error, (argv, error)
    # --model is fine when the llama.cpp engine is left out
    assert bench.parse_args(["--llama-server", str(fake_binary), "--model", str(tmp_path), "--servers", "local"]).servers == ["local"]


# -- the command line -------------------------------------------------------------------------------
def test_each_slot_gets_the_longest_prompt_and_its_new_tokens_rounded_up_to_256():
    assert llama_server_ctx_size(300, 160, 8) == 8 * 512
    assert llama_server_ctx_size(350, 160, 8) == 8 * 512, "350 + 160 + 2 = 512 fits a slot of 512"
    assert llama_server_ctx_size(351, 160, 8) == 8 * 768, "351 + 160 + 2 = 513 needs the next 256"
    assert llama_server_ctx_size(1000, 160, 1) == 1280
    for name, call in (("max_prompt_tokens", lambda: llama_server_ctx_size(0, 160, 8)),
                       ("max_new_tokens", lambda: llama_server_ctx_size(300, -1, 8)),
                       ("parallel", lambda: llama_server_ctx_size(300, 160, True))):
        with pytest.raises(ValueError, match=name):
            call()


def test_the_llama_server_command_line_sets_threads_slots_context_caching_template_and_sampling():
    command = llama_server_command("/opt/llama-server", "/m/model.gguf", 8123, threads=2, parallel=8, ctx_size=6144)
    assert command[0] == "/opt/llama-server"
    flags = {}
    for i, word in enumerate(command[1:], 1):
        if word.startswith("--"):
            value = command[i + 1] if i + 1 < len(command) and not command[i + 1].startswith("--") else True
            flags[word] = value
    assert flags == {"--model": "/m/model.gguf", "--host": "127.0.0.1", "--port": "8123", "--threads": "2",
                     "--threads-batch": "2", "--parallel": "8", "--no-kv-unified": True, "--ctx-size": "6144",
                     "--cache-prompt": True, "--jinja": True, "--metrics": True, "--no-webui": True,
                     "--samplers": "temperature;top_k;top_p", "--top-k": "0"}
    assert LLAMA_SAMPLERS.split(";") == ["temperature", "top_k", "top_p"], "rksc's order: temperature first"
    with pytest.raises(ValueError, match="ctx_size"):
        llama_server_command("b", "m", 8123, threads=2, parallel=8, ctx_size=4)
    with pytest.raises(ValueError, match="threads"):
        llama_server_command("b", "m", 8123, threads=0, parallel=8, ctx_size=4096)


# -- the subprocess ---------------------------------------------------------------------------------
def test_llama_server_starts_the_command_line_waits_for_health_and_stops_the_process(fake_binary, record):
    with llama_server(fake_binary, "/m/model.gguf", threads=2, parallel=8, ctx_size=4096, timeout_s=30) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        seen = json.loads(record.read_text())
        port = int(url.rsplit(":", 1)[1])
        assert seen["argv"] == llama_server_command(fake_binary, "/m/model.gguf", port, threads=2, parallel=8,
                                                    ctx_size=4096)[1:]
        assert seen["answers"][:2] == [503, 503], "yielded before /health said the model was loaded"
    assert process_gone(seen["pid"]), "the server process outlived its block"


def test_the_server_process_is_stopped_when_its_block_raises(fake_binary, record):
    port = servers.free_port()
    with pytest.raises(KeyboardInterrupt):
        with server_process([str(fake_binary), "--port", str(port)], port, "/health", name="fake", timeout_s=30):
            pid = json.loads(record.read_text())["pid"]
            raise KeyboardInterrupt  # Ctrl-C during the run
    assert process_gone(pid), "Ctrl-C left the server running"


def test_a_server_that_exits_before_it_is_ready_fails_with_its_output(fake_binary, record, monkeypatch):
    monkeypatch.setenv("FAKE_SERVER_FAIL", "1")
    port = servers.free_port()
    with pytest.raises(ServerFailed) as failed:
        with server_process([str(fake_binary), "--port", str(port)], port, "/health", name="fake", timeout_s=30):
            pytest.fail("yielded a server that exited")
    assert "fake exited (3)" in str(failed.value) and "error: cannot load model" in str(failed.value)


def test_a_server_that_never_gets_ready_fails_after_the_timeout_and_is_stopped(fake_binary, record, monkeypatch):
    monkeypatch.setenv("FAKE_SERVER_NOT_READY", "1000000")
    port = servers.free_port()
    with pytest.raises(ServerFailed, match="fake did not answer /health within 2 s"):
        with server_process([str(fake_binary), "--port", str(port)], port, "/health", name="fake", timeout_s=2):
            pytest.fail("yielded a server that never answered 200")
    assert process_gone(json.loads(record.read_text())["pid"])


# -- reading a running server -----------------------------------------------------------------------
METRICS = """# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total {tokens}
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing {busy}
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} 5
"""


def fake_llama_app(metrics_pages: list[str], seen: list[tuple[str, dict]], template: str, tokens: list[int]):
    fastapi = pytest.importorskip("fastapi")
    from fastapi.responses import PlainTextResponse

    app = fastapi.FastAPI()
    reads = {"metrics": 0}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics():
        page = metrics_pages[min(reads["metrics"], len(metrics_pages) - 1)]
        reads["metrics"] += 1
        return page

    @app.post("/apply-template")
    def apply_template(body: dict):
        seen.append(("/apply-template", body))
        return {"prompt": template}

    @app.post("/tokenize")
    def tokenize(body: dict):
        seen.append(("/tokenize", body))
        return {"tokens": tokens}

    return app, reads


def test_metrics_are_parsed_by_name_leaving_out_comments_and_labelled_series():
    assert parse_llama_metrics(METRICS.format(tokens=1234, busy=2)) == {
        "llamacpp:tokens_predicted_total": "1234", "llamacpp:requests_processing": "2"}


def test_the_decode_count_is_read_once_no_slot_is_busy():
    pages = [METRICS.format(tokens=100, busy=3), METRICS.format(tokens=140, busy=1), METRICS.format(tokens=151, busy=0)]
    app, reads = fake_llama_app(pages, [], "", [])
    with app_in_thread(app) as url:
        assert llama_server_decode_tokens(url, timeout_s=30) == 151, "read while a slot was still decoding"
    assert reads["metrics"] == 3


def test_a_decode_count_printed_rounded_or_a_slot_that_stays_busy_is_an_error():
    app, _ = fake_llama_app([METRICS.format(tokens="1.23457e+06", busy=0)], [], "", [])
    with app_in_thread(app) as url, pytest.raises(RuntimeError, match="rounds to six significant digits"):
        llama_server_decode_tokens(url)
    app, _ = fake_llama_app([METRICS.format(tokens=5, busy=1)], [], "", [])
    with app_in_thread(app) as url, pytest.raises(RuntimeError, match="still processes requests"):
        llama_server_decode_tokens(url, timeout_s=0.3)


class RenderingEngine:
    """What ``llama_server_prompt_difference`` reads of an ``RKSCEngine``."""

    def __init__(self, text: str, ids: list[int]) -> None:
        self.text, self.ids = text, ids

    def render_chat(self, messages):
        return self.text

    def encode_chat(self, messages):
        return self.ids


def test_the_prompt_check_passes_when_llama_server_renders_and_tokenizes_as_rksc():
    text = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    seen: list = []
    app, _ = fake_llama_app([""], seen, text, [1, 2, 3])
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    with app_in_thread(app) as url:
        assert llama_server_prompt_difference(url, RenderingEngine(text, [1, 2, 3]), [messages, messages]) is None
    assert seen[0] == ("/apply-template", {"messages": messages})
    assert seen[1] == ("/tokenize", {"content": text, "add_special": True, "parse_special": True}), \
        "the check must tokenize as the chat endpoint does"
    assert len(seen) == 4, "every prompt is checked"


def test_the_prompt_check_names_the_first_character_or_token_that_differs():
    app, _ = fake_llama_app([""], [], "<|im_start|>user\nQ", [1, 2, 3, 4])
    messages = [{"role": "user", "content": "Q"}]
    with app_in_thread(app) as url:
        other_text = llama_server_prompt_difference(url, RenderingEngine("<|im_start|>system\nHi", [1, 2, 3, 4]),
                                                    [messages])
        other_ids = llama_server_prompt_difference(url, RenderingEngine("<|im_start|>user\nQ", [1, 2, 9, 4]), [messages])
        shorter = llama_server_prompt_difference(url, RenderingEngine("<|im_start|>user\nQ", [1, 2, 3]), [messages])
    assert other_text is not None and "renders the chat otherwise from character 12" in other_text, other_text
    assert other_ids is not None and "tokenizes the same text otherwise from token 2: [3, 4] where rksc has [9, 4]" in other_ids
    assert shorter is not None and "from token 3" in shorter, shorter
