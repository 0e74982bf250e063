"""A branch's stop strings, found in the text a step added without scanning the whole text again."""

from __future__ import annotations

import random

from rksc_engine.config import SamplingParams
from rksc_engine.runtime.branch_output import append_token, first_stop
from rksc_engine.runtime.request import Branch


def test_first_stop_after_a_checked_prefix_finds_what_a_whole_scan_finds():
    rng = random.Random(0)
    stops = ("\n\n", "Q:", "END")
    for _ in range(300):
        text = "".join(rng.choice(["a", "b", "\n", "Q", ":", "E", "N", "D", " "]) for _ in range(40))
        whole = first_stop(text, stops)
        # Any prefix with no stop string in it may be skipped, a stop string straddling its end included.
        clean = whole if whole is not None else len(text)
        for checked in range(clean + 1):
            assert first_stop(text, stops, checked) == whole, (text, checked)


class _CharDetokenizer:
    """Decodes token ids as characters (``chr``), growing the text by the new tokens."""

    def extend(self, text, token_ids, state):
        state.read = len(token_ids)
        return "".join(map(chr, token_ids))

    def whole(self, text, token_ids, state):
        return "".join(map(chr, token_ids))


def test_a_stop_string_split_across_steps_ends_the_branch_and_each_step_scans_only_new_text(monkeypatch):
    from rksc_engine.runtime import branch_output

    scanned = []
    real = branch_output.first_stop

    def recording(text, stops, checked=0):
        scanned.append(len(text) - checked)
        return real(text, stops, checked)

    monkeypatch.setattr(branch_output, "first_stop", recording)
    params = SamplingParams(max_new_tokens=100, stop=("STOP",))
    branch = Branch(0)
    for char in "x" * 30 + "STOP" + "tail":
        append_token(branch, ord(char), 0.0, params, 100, frozenset(), _CharDetokenizer())
        if branch.finish_reason is not None:
            break
    assert branch.finish_reason == "stop" and branch.text == "x" * 30
    assert max(scanned) == 1, "a step scanned more than the character it added"
