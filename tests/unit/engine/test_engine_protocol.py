"""The engine protocols (``rksc_engine.protocol``) against the engines: ``RKSCEngine`` is an ``Engine``
and a ``LocalEngine``; ``RemoteEngine`` is an ``Engine`` and not a ``LocalEngine``; and every member a
protocol names exists on the engines that must offer it, a property as a property, a method with the
same parameters (names, order, kinds; what the protocol may leave out has a default on the engine)
and the same sync/async kind. So a method added to one engine and forgotten on the other, or a
parameter renamed on one of them, fails here."""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import pytest

from rksc_engine import RemoteEngine, RKSCEngine
from rksc_engine.protocol import Engine, LocalEngine

# No server listens on port 9 (discard): nothing here may connect. ``model`` is given so that
# ``model_name`` answers without asking the server.
NO_SERVER = "http://127.0.0.1:9/v1"

def protocol_members(protocol: type) -> dict[str, Any]:
    """The members ``protocol`` declares, its own and those of the protocols it extends: methods and
    properties by name, data members (annotations) as None."""
    members: dict[str, Any] = {}
    mro = protocol.__mro__
    for klass in reversed(mro[:mro.index(Protocol)]):  # the protocols, not Protocol, Generic, object
        for name in getattr(klass, "__annotations__", {}):
            if not name.startswith("_"):
                members[name] = None
        for name, value in vars(klass).items():
            if not name.startswith("_"):
                members[name] = value
    return members


ENGINE_MEMBERS = protocol_members(Engine)
LOCAL_MEMBERS = protocol_members(LocalEngine)
LOCAL_ONLY_MEMBERS = {name: value for name, value in LOCAL_MEMBERS.items() if name not in ENGINE_MEMBERS}


def test_the_protocols_declare_what_the_engines_are_used_for():
    # Guards protocol_members itself: an empty or partial listing would make the checks below vacuous.
    assert {"submit", "generate", "agenerate", "astream", "stats", "encode", "encode_chat", "model_name",
            "reason", "areason", "tree_search"} <= set(ENGINE_MEMBERS)
    assert {"tokenizer", "model", "config", "prefix_cache", "exclusive", "cached_prefix",
            "validate_request"} <= set(LOCAL_ONLY_MEMBERS)


# -- isinstance ----------------------------------------------------------------------------------
@pytest.fixture
def remote():
    with RemoteEngine(NO_SERVER, model="tiny") as engine:
        yield engine


def test_a_local_engine_is_an_engine_and_a_local_engine(tiny_engine):
    assert isinstance(tiny_engine, Engine)
    assert isinstance(tiny_engine, LocalEngine)


def test_a_remote_engine_is_an_engine_but_not_a_local_engine(remote):
    assert isinstance(remote, Engine)
    assert not isinstance(remote, LocalEngine)
    present = sorted(name for name in ("model", "tokenizer", "config", "prefix_cache", "context_window", "exclusive",
                                       "cached_prefix", "validate_request") if hasattr(remote, name))
    assert not present, f"RemoteEngine has what needs the model in this process: {present}"


@pytest.mark.parametrize(("keyword", "error", "match"), [
    ({"logits_processor": lambda ids, scores: scores}, NotImplementedError, "logits processor"),
    ({"monitor": lambda *a: None}, TypeError, "observe"),
    ({"max_branches": 4}, ValueError, "needs a monitor"),
    ({"max_branches": 1}, ValueError, "max_branches must be >= n"),
])
def test_a_remote_engine_refuses_what_it_cannot_run_before_sending(remote, keyword, error, match):
    sent = []
    remote._workers.submit = sent.append  # nothing may be queued for the network
    with pytest.raises(error, match=match):
        remote.submit("hello", 2, **keyword)
    assert sent == [] and remote.stats().requests == 0


def test_a_remote_engine_cannot_render_a_chat_template(remote):
    with pytest.raises(NotImplementedError, match="tokenizer"):
        remote.encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)


def test_something_that_is_no_engine_is_neither():
    assert not isinstance(object(), Engine)
    assert not isinstance("http://127.0.0.1:9/v1", LocalEngine)


# -- members -------------------------------------------------------------------------------------
def signature_mismatches(protocol_method: Any, engine_method: Any) -> list[str]:
    """How ``engine_method`` cannot stand in for ``protocol_method``; empty when it can."""
    problems = []
    if inspect.iscoroutinefunction(protocol_method) != inspect.iscoroutinefunction(engine_method):
        problems.append("one is async and the other is not")
    wanted = list(inspect.signature(protocol_method).parameters.values())[1:]  # without self
    given = list(inspect.signature(engine_method).parameters.values())[1:]
    by_name = {p.name: p for p in given}
    kinds = {p.kind for p in given}
    positional = [p.name for p in given if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for index, p in enumerate(wanted):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            if p.kind not in kinds:
                problems.append(f"takes no {'*' if p.kind == p.VAR_POSITIONAL else '**'}{p.name}")
            continue
        q = by_name.get(p.name)
        if q is None:
            problems.append(f"has no parameter {p.name!r}")
            continue
        if p.kind == p.POSITIONAL_OR_KEYWORD and (q.kind != q.POSITIONAL_OR_KEYWORD
                                                  or positional.index(q.name) != index):
            problems.append(f"{p.name!r} is not the positional-or-keyword parameter {index}")
        if p.kind == p.KEYWORD_ONLY and q.kind not in (q.KEYWORD_ONLY, q.POSITIONAL_OR_KEYWORD):
            problems.append(f"{p.name!r} cannot be passed by keyword")
        if p.default is not p.empty and q.default is q.empty:
            problems.append(f"{p.name!r} has a default in the protocol but not here")
    names = {p.name for p in wanted}
    for q in given:
        if q.name not in names and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD) and q.default is q.empty:
            problems.append(f"its extra parameter {q.name!r} has no default")
    return problems


def member_cases(members: dict[str, Any], engines: tuple[type, ...]) -> list[Any]:
    cases = []
    for name in sorted(members):
        for engine in engines:
            cases.append(pytest.param(engine, name, members[name], id=f"{engine.__name__}.{name}"))
    return cases


def check_member(engine_class: type, name: str, declared: Any) -> None:
    actual = inspect.getattr_static(engine_class, name, None)
    if declared is None:  # a data member: set on the instance
        return
    if isinstance(declared, property):
        assert isinstance(actual, property), f"{engine_class.__name__}.{name} must be a property, got {actual!r}"
        return
    assert actual is not None and callable(actual), f"{engine_class.__name__} has no method {name}"
    problems = signature_mismatches(declared, actual)
    assert not problems, (f"{engine_class.__name__}.{name}{inspect.signature(actual)} does not match the protocol's "
                          f"{name}{inspect.signature(declared)}: {'; '.join(problems)}")


@pytest.mark.parametrize(("engine_class", "name", "declared"), member_cases(ENGINE_MEMBERS, (RKSCEngine, RemoteEngine)))
def test_both_engines_offer_every_engine_member_with_its_signature(engine_class, name, declared):
    check_member(engine_class, name, declared)


@pytest.mark.parametrize(("engine_class", "name", "declared"), member_cases(LOCAL_ONLY_MEMBERS, (RKSCEngine,)))
def test_the_local_engine_offers_every_local_engine_member_with_its_signature(engine_class, name, declared):
    check_member(engine_class, name, declared)


@pytest.mark.parametrize("name", sorted(n for n, v in LOCAL_ONLY_MEMBERS.items() if v is None))
def test_the_local_engines_data_members_are_set(tiny_engine, name):
    assert hasattr(tiny_engine, name), f"RKSCEngine has no {name}"


def test_the_signature_check_catches_a_renamed_or_missing_parameter():
    class Good:
        def encode_chat(self, messages, **template_kwargs): ...

    class Renamed:
        def encode_chat(self, prompt): ...

    class NarrowerSubmit:
        def submit(self, prompt, n=1, params=None, *, stream=False): ...

    assert signature_mismatches(ENGINE_MEMBERS["encode_chat"], Good.encode_chat) == []
    assert signature_mismatches(ENGINE_MEMBERS["encode_chat"], Renamed.encode_chat)
    assert signature_mismatches(ENGINE_MEMBERS["submit"], NarrowerSubmit.submit)
