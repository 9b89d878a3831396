"""The shape of the house, read from the source (design.md): the layers import one way, there is
one step loop that serves requests, client and engine core talk in typed messages, and the engine
side does no text work."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import flashlane

SRC = Path(flashlane.__file__).resolve().parent

# what a package must not import (kernels <- models <- engine <- server; bench speaks HTTP, analyze
# reads configs)
FORBIDDEN = {
    "kernels": {"models", "engine", "server", "cli", "bench", "tune", "evaluate", "compress", "analyze"},
    "models": {"engine", "server", "cli", "bench", "tune", "evaluate", "compress"},
    "engine": {"server", "cli", "bench", "tune"},
    "bench": {"kernels", "models", "engine", "server"},
    "analyze": {"kernels", "models", "engine", "server"},
}

# every place allowed to call an engine's step(), and why
STEP_CALLERS = {
    ("engine/core.py", "EngineCore.step"): "the serving loop's step (run_core_loop calls it)",
    ("engine/llm.py", "LLM.generate"): "the offline LLM: no client, no transport",
    ("engine/llm.py", "LLM.score"): "the offline LLM scoring windows",
    ("engine/llm_engine.py", "LLMEngine._warm_up"): "compiling before serving",
    ("engine/profile_steps.py", "_timed_step"): "`flashlane profile` times fixed batches step by step",
    ("engine/profile_steps.py", "profile_steps"): "`flashlane profile` fills its batches before timing",
    ("simulate/sim_server.py", "SimServer._loop"): "the simulator steps a SimEngine (the scheduler and cache "
                                                   "manager in simulated time), never an LLMEngine",
}


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _sources():
    return sorted(SRC.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def _imports(path: Path) -> set[str]:
    """Absolute names of the flashlane modules ``path`` imports (relative imports resolved;
    imports inside functions count too)."""
    package = ["flashlane", *path.relative_to(SRC).parent.parts]
    names = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names |= {f"{module}.{a.name}" for a in node.names}   # `from .. import engine`
    return {n for n in names if n.split(".")[0] == "flashlane"}


def test_the_layers_import_one_way():
    wrong = []
    for path in _sources():
        parts = path.relative_to(SRC).parts
        if len(parts) < 2 or parts[0] not in FORBIDDEN:
            continue
        for name in _imports(path):
            target = name.split(".")[1] if "." in name else None
            if target in FORBIDDEN[parts[0]] and target != parts[0]:
                wrong.append(f"{_rel(path)} imports {name}")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_no_model_imports_the_engine():
    # stated on its own: model code is the engine's input, never its user
    wrong = [f"{_rel(p)}: {n}" for p in sorted((SRC / "models").rglob("*.py")) for n in _imports(p)
             if n == "flashlane.engine" or n.startswith("flashlane.engine.")]
    assert not wrong, wrong


def _functions(tree: ast.Module):
    """(qualified name, node) of every function, methods as Class.method."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
    yield from walk(tree, "")


def _is_engine_step(call: ast.Call, qualname: str) -> bool:
    """``<engine>.step()``: the receiver names an engine (``engine``, ``self.engine``, ``llm.engine``),
    or is ``self`` inside an engine class. Optimisers, plots and detokenizers have steps too."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr == "step"):
        return False
    receiver = ast.unparse(func.value)
    if receiver == "self":
        return qualname.split(".")[0].endswith("Engine")
    return receiver.split(".")[-1].lower().endswith("engine")


def _step_calls() -> dict[tuple[str, str], int]:
    found: dict[tuple[str, str], int] = {}
    for path in _sources():
        for qualname, fn in _functions(_tree(path)):
            inner = {id(n) for _, f in _functions(fn) for n in ast.walk(f)}   # counted in their own function
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and id(node) not in inner and _is_engine_step(node, qualname):
                    key = (_rel(path), qualname)
                    found[key] = found.get(key, 0) + 1
    return found


def test_one_step_loop_serves_requests():
    calls = _step_calls()
    assert ("engine/core.py", "EngineCore.step") in calls            # the finder sees what it looks for
    unexpected = sorted(set(calls) - set(STEP_CALLERS))
    assert not unexpected, f"engine steps outside the one loop (engine/core.py:run_core_loop): {unexpected}"
    assert not set(STEP_CALLERS) - set(calls), "STEP_CALLERS lists a place that no longer steps: drop it"
    # run_core_loop is defined once, and both transports run it
    defined = [(_rel(p), q) for p in _sources() for q, _ in _functions(_tree(p)) if q == "run_core_loop"]
    assert defined == [("engine/core.py", "run_core_loop")]
    for transport in ("engine/thread_transport.py", "engine/core_process.py"):
        called = {ast.unparse(n.func) for n in ast.walk(_tree(SRC / transport)) if isinstance(n, ast.Call)}
        assert "run_core_loop" in called, transport
    loop = dict(_functions(_tree(SRC / "engine/core.py")))["run_core_loop"]
    assert any(isinstance(n, ast.While) for n in ast.walk(loop))
    assert "core.step" in {ast.unparse(n.func) for n in ast.walk(loop) if isinstance(n, ast.Call)}


def test_the_step_finder_tells_an_engine_step_from_others():
    def found(source: str, qualname: str = "f") -> bool:
        call = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call))
        return _is_engine_step(call, qualname)

    assert found("engine.step()") and found("self.engine.step()") and found("llm.engine.step()")
    assert found("self.step()", "LLMEngine._warm_up") and found("self._engine.step()")
    assert not found("opt.step()") and not found("ax.step(x, y)") and not found("s.detok.step(ids)")
    assert not found("self.step()", "Trainer.run") and not found("engine.stepping()")


MESSAGE_SENDS = {"send", "put", "put_nowait"}
# where messages between client and core are made, carried and read
MESSAGE_FILES = ("client.py", "core.py", "core_process.py", "engine_process.py", "thread_transport.py",
                 "process_transport.py", "llm.py")


def test_client_and_core_send_typed_messages_not_tuples():
    wrong = []
    for name in MESSAGE_FILES:
        for node in ast.walk(_tree(SRC / "engine" / name)):
            sends_a_literal = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                               and node.func.attr in MESSAGE_SENDS and node.args
                               and isinstance(node.args[0], (ast.Tuple, ast.List, ast.Dict)))
            # reading a message by position: ``msg[0] == "ready"`` was the old protocol
            reads_by_position = (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                                 and node.value.id in ("msg", "message", "reply")
                                 and isinstance(node.slice, ast.Constant))
            if sends_a_literal or reads_by_position:
                wrong.append(f"engine/{name}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)
    # and nothing anywhere sends a tuple down a pipe
    for path in _sources():
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("conn.send") and node.args
                    and isinstance(node.args[0], ast.Tuple)):
                wrong.append(f"{_rel(path)}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)


def test_the_engine_side_does_no_text_work():
    text_modules = {"flashlane.engine.output_processor", "flashlane.engine.detokenizer"}
    for name in ("llm_engine.py", "core.py", "core_process.py", "scheduler.py", "runner.py"):
        used = _imports(SRC / "engine" / name) & text_modules
        assert not used, f"engine/{name} imports {used}"
