"""The first load of the default model converts its GGUF file; what that prints: one progress bar
on a terminal, nothing in a log, and never the cursor-up escapes of nested bars.

Each test converts the real GGUF file into its own empty cache, in a child process whose stderr is
a pipe (a log) or a pseudo-terminal."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from rksc_engine.runtime.loading import DEFAULT_MODEL_NAME, default_gguf_path

pytestmark = pytest.mark.integration

CONVERT = "from rksc_engine.runtime.loading import ensure_default_model; print(ensure_default_model())"
CURSOR_UP = b"\x1b[A"
TRANSFORMERS_BARS = (b"GGUF tensors", b"Loading weights", b"Writing model shards")


@pytest.fixture
def empty_cache(tmp_path):
    default_gguf_path()  # the test needs the embedded model installed; this names the install command if not
    return {**os.environ, "RKSC_CACHE_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def test_converting_into_a_log_prints_no_progress_bar(empty_cache):
    done = subprocess.run([sys.executable, "-c", CONVERT], env=empty_cache, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert CURSOR_UP not in done.stderr, "nested progress bars wrote cursor-up escapes into the log"
    assert b"%|" not in done.stderr, f"a progress bar was drawn into a log: {done.stderr[-600:]!r}"
    assert (empty_cache["RKSC_CACHE_DIR"] + "/models/" + DEFAULT_MODEL_NAME).encode() in done.stdout


def test_converting_on_a_terminal_draws_one_bar_without_cursor_up_escapes(empty_cache):
    leader, follower = pty.openpty()
    # A new pseudo-terminal is 0 columns wide, and tqdm draws nothing in 0 columns.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        child = subprocess.Popen([sys.executable, "-c", CONVERT], env=empty_cache, stdout=subprocess.PIPE,
                                 stderr=follower)
        os.close(follower)
        drawn = bytearray()
        while True:
            try:
                piece = os.read(leader, 65536)
            except OSError:  # the terminal closes when the child exits (EIO on Linux)
                break
            if not piece:
                break
            drawn += piece
        assert child.wait(timeout=600) == 0, bytes(drawn[-2000:]).decode(errors="replace")
        child.stdout.close()
    finally:
        os.close(leader)
    assert b"rksc: converting" in drawn and b"3/3" in drawn, f"the conversion's bar is missing: {bytes(drawn[-600:])!r}"
    assert CURSOR_UP not in drawn, "nested progress bars redrew with cursor-up escapes"
    drawn_bars = [name for name in TRANSFORMERS_BARS if name in drawn]
    assert drawn_bars == [], f"transformers drew its own bars under rksc's: {drawn_bars}"
