"""Package layering, checked on the import graph that the code's own imports draw (every import,
lazy ones inside functions included):

* layers: the base modules (settings, result types, byte sizes as text, token helpers) < ``kvcache/`` < ``runtime/`` <
  ``protocol.py`` (what an engine offers) < reasoning, structured output and workloads (which see an
  engine only through the protocol) < the facades (``engine.py``, ``remote.py``) < the integrations,
  the server, the bench and the command line; no module imports a layer above its own, and
  ``rksc_engine`` imports no third-party adapter or HTTP package;
* no circle anywhere in ``rksc_*``;
* no ``_private`` name is imported from another module, and no ``_private`` attribute is touched
  outside the module that defines it (``obj._x``, ``getattr(obj, "_x")``), over ``rksc_*``,
  ``benchmarks/`` and the cookbook's notebooks.

Run this file with ``-s`` to print the graph between layers.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import rksc_bench.cli
import rksc_cli.ask
import rksc_serve.cli
from rksc_cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rksc_engine", "rksc_integrations", "rksc_serve", "rksc_bench", "rksc_cli")
THIRD_PARTY_ABOVE_ENGINE = ("langchain", "langchain_core", "llama_index", "fastapi", "starlette", "uvicorn",
                            "prometheus_client", "ray")

# Layers, lowest first; a module belongs to the first entry whose prefix matches its dotted name.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("rksc_engine.config", "rksc_engine.results", "rksc_engine.decoder_parts", "rksc_engine.units")),
    ("kvcache", ("rksc_engine.kvcache",)),
    ("runtime", ("rksc_engine.runtime",)),
    ("protocol", ("rksc_engine.protocol",)),
    ("reasoning", ("rksc_engine.reasoning", "rksc_engine.structured")),
    ("evaluation", ("rksc_engine.evaluation",)),
    ("facade", ("rksc_engine.engine", "rksc_engine.remote", "rksc_engine.remote_branches", "rksc_engine.remote_probe",
                "rksc_engine.remote_wire")),
    # the package's names
    ("package", ("rksc_engine.__init__",)),
    ("adapters", ("rksc_integrations", "rksc_serve", "rksc_bench")),
    ("command", ("rksc_cli",)),
]
LAYER_RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}
# Layers that may import a sibling of the same rank (an adapter may use the server's client, say).
# Within "reasoning", modules import each other freely, as long as no circle forms.

# Private attributes of other libraries that rksc must read, each with its reason.
FOREIGN_PRIVATE = {
    "_name_or_path",  # transformers' PretrainedConfig: the model's directory, for the model's name
    "_scaled_dot_product_flash_attention_for_cpu",  # torch's fused CPU attention, which returns the log-sum-exp
    "_is_mkldnn_bf16_supported",  # torch's own check that oneDNN runs bf16 natively on this CPU
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts)


def package_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            files[module_name(path)] = path
    return files


def resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute dotted name an ``ImportFrom`` reaches from ``module``."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".")[:-1]  # a package's own module is named "<package>.__init__"
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` imports (a name imported from a package that is itself
    a module of ``known`` counts as that module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(module, path, node)
            targets = [f"{target}.{alias.name}" for alias in node.names] + [target]
        else:
            continue
        for target in targets:
            if target in known:
                found.add(target)
            elif f"{target}.__init__" in known and target != module.removesuffix(".__init__"):
                found.add(f"{target}.__init__")
    found.discard(module)
    return found


def third_party_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def layer_of(module: str) -> str:
    for name, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {Path(__file__).name}")


def import_graph() -> dict[str, set[str]]:
    files = package_files()
    known = set(files)
    # A package's __init__ is reached by importing the package itself.
    return {module: imports_of(module, path, known) for module, path in files.items()}


def test_every_module_imports_only_its_own_layer_or_lower(capsys):
    graph = import_graph()
    upward = []
    for module, targets in graph.items():
        rank = LAYER_RANK[layer_of(module)]
        for target in targets:
            if LAYER_RANK[layer_of(target)] > rank:
                upward.append(f"{module} ({layer_of(module)}) -> {target} ({layer_of(target)})")
    between = defaultdict(set)
    for module, targets in graph.items():
        for target in targets:
            if layer_of(module) != layer_of(target):
                between[layer_of(module)].add(layer_of(target))
    with capsys.disabled():
        print("\nimports between layers (lowest first):")
        for layer in sorted(between, key=LAYER_RANK.get):
            print(f"  {layer} -> {', '.join(sorted(between[layer], key=LAYER_RANK.get))}")
    assert not upward, "imports that point up a layer:\n" + "\n".join(sorted(upward))


def test_runtime_and_kvcache_import_nothing_above_them():
    graph = import_graph()
    allowed = {"base", "kvcache", "runtime"}
    offenders = [f"{m} -> {t}" for m, targets in graph.items() if layer_of(m) in ("runtime", "kvcache")
                 for t in targets if layer_of(t) not in allowed or (layer_of(m) == "kvcache" and layer_of(t) == "runtime")]
    assert not offenders, offenders


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    index, low, on_stack, stack, circles = {}, {}, set(), [], []
    counter = [0]

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not circles, f"import circles: {circles}"


def test_the_engine_package_imports_no_adapter_or_http_package():
    offenders = {
        str(path.relative_to(ROOT)): sorted(third_party_imports(path) & set(THIRD_PARTY_ABOVE_ENGINE + PACKAGES[1:]))
        for path in sorted((ROOT / "rksc_engine").rglob("*.py"))
    }
    offenders = {path: names for path, names in offenders.items() if names}
    assert not offenders, f"rksc_engine modules import upper layers: {offenders}"


# -- private names ----------------------------------------------------------------------------------
def sources() -> list[tuple[str, ast.AST]]:
    """``(label, tree)`` of every module of rksc_*, every benchmark, and every notebook's code."""
    out = []
    for folder in (*PACKAGES, "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            out.append((str(path.relative_to(ROOT)), ast.parse(path.read_text(), filename=str(path))))
    for path in sorted((ROOT / "cookbook").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("!", "%")))
        out.append((str(path.relative_to(ROOT)), ast.parse(code, filename=str(path))))
    return out


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, attributes it assigns, parameters."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if is_private(n)}


def test_no_private_name_is_imported_from_another_module():
    offenders = []
    for label, tree in sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                root = (node.module or "").split(".")[0]
                if node.level == 0 and root not in PACKAGES:
                    continue
                offenders += [f"{label}:{node.lineno} {alias.name}" for alias in node.names if is_private(alias.name)]
    assert not offenders, offenders


def private_attribute_offenders(label: str, tree: ast.AST) -> list[str]:
    """Private attributes ``tree`` touches that it does not define itself (on anything but ``self``
    or ``cls``, however the object was reached, or by name through ``getattr``/``setattr``/``hasattr``)."""
    own = defined_private_names(tree) | FOREIGN_PRIVATE
    offenders = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr not in own:
                offenders.append(f"{label}:{node.lineno} .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and is_private(node.args[1].value) and node.args[1].value not in own):
            offenders.append(f"{label}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    return offenders


def test_no_private_attribute_is_touched_outside_its_own_module():
    offenders = [o for label, tree in sources() for o in private_attribute_offenders(label, tree)]
    assert not offenders, "private attributes touched outside their module:\n" + "\n".join(offenders)


@pytest.mark.parametrize("snippet, expected", [
    ("x = engine._lock", [".x:1 ._lock"]),
    ("e = engine\ne._scheduler.step()", [".x:2 ._scheduler"]),
    ("getattr(engine, '_x')", [".x:1 getattr(..., '_x')"]),
    ("self.llm._model", [".x:1 ._model"]),
    ("class A:\n    def __init__(self):\n        self._n = 1\n    def f(self, other):\n        return other._n", []),
])
def test_the_private_attribute_rule_catches_what_a_name_check_missed(snippet, expected):
    assert private_attribute_offenders(".x", ast.parse(snippet)) == expected


# -- the command ------------------------------------------------------------------------------------
def test_the_rksc_command_routes_ask_to_the_engine_bench_to_rksc_bench_and_serve_to_rksc_serve():
    parser = build_parser()
    assert parser.parse_args(["ask", "What is 2+3?"]).func is rksc_cli.ask.run, "rksc ask must run rksc_cli.ask.run"
    assert parser.parse_args(["bench"]).func is rksc_bench.cli.run, "rksc bench must run rksc_bench.cli.run"
    assert parser.parse_args(["serve"]).func is rksc_serve.cli.run, "rksc serve must run rksc_serve.cli.run"


def test_the_rksc_command_imports_no_http_server_until_serve_runs():
    code = ("import sys, rksc_cli; rksc_cli.build_parser(); "
            "bad = [m for m in ('fastapi', 'uvicorn', 'prometheus_client') if m in sys.modules]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, f"importing rksc_cli pulled in HTTP server modules (rksc --help must work without the serve extra): {out.stderr[-500:]}"


def touches_sys_path(path: Path) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == "path"
               and isinstance(node.value, ast.Name) and node.value.id == "sys"
               for node in ast.walk(ast.parse(path.read_text(), filename=str(path))))


def test_no_benchmark_edits_sys_path():
    edits = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "benchmarks").glob("*.py")) if touches_sys_path(path)]
    assert not edits, f"benchmarks must import the installed package, not edit sys.path: {edits}"
