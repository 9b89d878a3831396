"""The layers of the house (design.md): imports run one way, ``kernels <- models <- engine <-
server``; ``bench`` (HTTP only) and ``analyze`` (configs only) stand apart; ``cli`` sits on top;
and no flashlane module takes part in an import cycle. Read from the source with ``ast``, so every
import counts, also the lazy ones inside functions (the circles this guards against were lazy)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# The torch-free leaves everyone may read: one config parser, one cache layout, the preset
# registry (names, configs, the tiny tokenizer; no model code: models write preset weights).
BASE = {"flashlane.config", "flashlane.cache_spec", "flashlane.presets", "flashlane.acceptance"}
# torch-level tools that are not kernels: the profilers' named ranges and the machine description
# every measurement records (it reads the kernels' CPU capability detection)
RUNTIME = {"flashlane.trace_ranges", "flashlane.machine"}
# layer -> the layers it may import. `root` is the package itself, which re-exports the engine's
# LLM / SamplingParams lazily; importing its plain attributes (``__version__``) is no edge.
ALLOWED = {
    "base": {"base"},
    "kernels": {"base", "kernels"},
    "runtime": {"base", "kernels", "runtime"},
    "models": {"base", "kernels", "runtime", "models"},
    "engine": {"base", "kernels", "runtime", "models", "engine"},
    "server": {"base", "kernels", "runtime", "models", "engine", "server"},
    # bench speaks HTTP to any server: nothing of engine, models, server, kernels or presets
    # (a preset name is resolved by the caller and handed over as a path).
    "bench": {"bench", "flashlane.config", "flashlane.cache_spec"},
    # analyze reads configs, including the preset registry's config dicts (torch-free, imports
    # no flashlane module), so `flashlane analyze tiny-flash` works without any model code; and
    # the acceptance arithmetic of speculative decoding (torch-free, imports nothing).
    "analyze": {"analyze", "flashlane.config", "flashlane.cache_spec", "flashlane.presets", "flashlane.acceptance"},
    # evaluate drives the offline engine (accuracy, speed and memory of its options)
    "evaluate": {"base", "kernels", "runtime", "models", "engine", "evaluate"},
    # compress calibrates models in plain torch (the engine's cache pools) and writes checkpoints
    "compress": {"base", "kernels", "runtime", "models", "engine", "compress"},
    # tune starts servers as processes and measures them with the bench (HTTP only); the results
    # store is plain SQLite and imports nothing else of flashlane
    "tune": {"tune", "bench", "results", "flashlane.config", "flashlane.cache_spec"},
    "results": {"results"},
    # simulate drives the engine's real scheduler and cache manager (meta tensors) with analyze's
    # step-cost model in place of the model, behind an in-memory server that the bench's own
    # replay talks to (so it writes bench's schema); nothing but cli imports simulate
    "simulate": {"base", "kernels", "runtime", "models", "engine", "analyze", "bench", "simulate"},
    "cli": {"base", "kernels", "runtime", "models", "engine", "server", "bench", "analyze", "evaluate", "tune", "results", "compress", "simulate", "cli", "root"},
    "root": {"base", "kernels", "runtime", "models", "engine", "server", "bench", "analyze", "evaluate", "tune", "results", "compress", "simulate", "cli", "root"},
}


def module_files(src: Path, package: str = "flashlane") -> dict[str, Path]:
    out = {}
    for p in sorted((src / package).rglob("*.py")):
        parts = list(p.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _static_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def import_graph(src: Path, package: str = "flashlane") -> dict[str, set[str]]:
    """module -> the flashlane modules it imports (anywhere in its source)."""
    mods = module_files(src, package)
    root_names = _static_names(ast.parse(mods[package].read_text())) if package in mods else set()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == package:
                        deps.add(a.name if a.name in mods else a.name.rpartition(".")[0])
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != package:
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if sub in mods:
                        deps.add(sub)
                    elif not (target == package and a.name in root_names):
                        deps.add(target)
        deps.discard(name)
        graph[name] = deps
    return graph


def layer(module: str) -> str:
    if module in BASE:
        return "base"
    if module in RUNTIME:
        return "runtime"
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    if parts[1] in ALLOWED:
        return parts[1]
    raise AssertionError(f"{module}: no layer for it; add it to ALLOWED in {Path(__file__).name}")


def violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in sorted(graph.items()):
        allowed = ALLOWED[layer(mod)]
        for dep in sorted(deps):
            if layer(dep) not in allowed and dep not in allowed:
                out.append(f"{mod} ({layer(mod)}) imports {dep} ({layer(dep)})")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph():
    return import_graph(SRC)


def test_the_graph_sees_lazy_and_relative_imports(graph):
    # a function-level import, a relative one, and the root package's lazy re-export
    assert "flashlane.models.gguf_loader" in graph["flashlane.models.registry"]
    assert "flashlane.presets" in graph["flashlane.models.registry"]
    assert "flashlane.engine.llm" in graph["flashlane"]
    assert len(graph) > 100


def test_imports_run_one_way(graph):
    assert violations(graph) == []


def test_bench_and_analyze_stand_apart(graph):
    forbidden = ("flashlane.engine", "flashlane.models", "flashlane.server", "flashlane.kernels",
                 "flashlane.cli", "flashlane.presets")
    for part, other in (("bench", "analyze"), ("analyze", "bench")):
        for mod, deps in graph.items():
            if mod.startswith(f"flashlane.{part}"):
                bad = [d for d in deps if d.startswith(forbidden + (f"flashlane.{other}",))
                       and not (part == "analyze" and d == "flashlane.presets")]
                assert bad == [], f"{mod} imports {bad}"
    assert not any(d == "flashlane" for m, ds in graph.items() if m.startswith("flashlane.bench") for d in ds)


def test_tune_and_results_stand_apart(graph):
    forbidden = ("flashlane.engine", "flashlane.models", "flashlane.server", "flashlane.kernels",
                 "flashlane.cli", "flashlane.presets", "flashlane.analyze")
    for mod, deps in graph.items():
        if mod.startswith(("flashlane.tune", "flashlane.results")):
            bad = [d for d in deps if d.startswith(forbidden) or d == "flashlane"
                   or (mod.startswith("flashlane.results") and not d.startswith("flashlane.results"))]
            assert bad == [], f"{mod} imports {bad}"
    assert any(m.startswith("flashlane.tune") for m in graph) and "flashlane.results.store" in graph


def test_no_import_cycles(graph):
    assert cycles(graph) == []


def test_the_checks_catch_a_circle_and_a_wrong_way_import(tmp_path):
    pkg = tmp_path / "flashlane"
    for sub in ("models", "engine", "bench"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("__version__ = '0'\n")
    (pkg / "presets.py").write_text("def make():\n    from .models.registry import write\n")
    (pkg / "models" / "registry.py").write_text("from .. import presets\nfrom ..engine import llm\n")
    (pkg / "engine" / "llm.py").write_text("import flashlane.models.registry\n")
    (pkg / "bench" / "text_synth.py").write_text("from flashlane import __version__, presets\n")
    g = import_graph(tmp_path)
    assert g["flashlane.bench.text_synth"] == {"flashlane.presets"}
    assert violations(g) == [
        "flashlane.bench.text_synth (bench) imports flashlane.presets (base)",
        "flashlane.models.registry (models) imports flashlane.engine.llm (engine)",
        "flashlane.presets (base) imports flashlane.models.registry (models)",
    ]
    assert cycles(g) == [["flashlane.engine.llm", "flashlane.models.registry", "flashlane.presets"]]
