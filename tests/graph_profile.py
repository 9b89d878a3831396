"""What ran inside compiled graphs, from a torch.profiler run (test helper)."""

from __future__ import annotations


def inside_graph(event) -> bool:
    """Whether a profiler event ran inside a compiled graph's call."""
    while event is not None:
        if event.name.startswith("## Call CompiledFxGraph"):
            return True
        event = event.cpu_parent
    return False


def graph_calls(events) -> list:
    return [e for e in events if e.name.startswith("## Call CompiledFxGraph")]


def aten_matmuls_inside_graphs(events) -> list[str]:
    """aten mm / addmm calls made from inside compiled graphs (Inductor's decomposition leaves none)."""
    return [e.name for e in events if e.name in ("aten::mm", "aten::addmm") and inside_graph(e)]
