"""Serving stacks: named, reproducible server set-ups that `compare` runs each model under, so it
can reproduce the public finding (Flash slower per task) and show what closes it.

A stack gives a server command by model *role*: `hybrid` (linear-attention layers, GLM-5.3-Flash
class) or `standard` (attention in every layer, GLM-5.3 class), and declares the mechanisms it
has. Which target has which role is decided by the caller (compare: from the model's config when
it can read one, else A = hybrid, B = standard). Stacks are files (bench/stack_files.py); the
three built-ins are the files in bench/stacks/, all `flashlane serve` flag sets. Eager execution
is the engine default; the `flashlane` stack adds static-graph decode (`--compile`).
"""

from __future__ import annotations

from pathlib import Path

from .stack_files import ROLES, Mechanisms, RoleSpec, Stack, load_stack_paths

__all__ = [
    "BUILTIN_DIR",
    "DEFAULT_STACKS",
    "ROLES",
    "STACKS",
    "Mechanisms",
    "RoleSpec",
    "Stack",
    "parse_stacks",
]

BUILTIN_DIR = Path(__file__).with_name("stacks")
DEFAULT_STACKS = ("naive", "hybrid-cache-gap", "flashlane")


def _builtins() -> dict[str, Stack]:
    found = load_stack_paths([BUILTIN_DIR])
    missing = [n for n in DEFAULT_STACKS if n not in found]
    if missing:
        raise RuntimeError(f"built-in stack files missing from {BUILTIN_DIR}: {', '.join(missing)}")
    return {n: found[n] for n in (*DEFAULT_STACKS, *found)}


STACKS: dict[str, Stack] = _builtins()


def parse_stacks(text: str | None, known: dict[str, Stack] | None = None,
                 default: tuple[str, ...] | list[str] | None = None) -> list[Stack]:
    """'naive,flashlane' -> those stacks, in the order given; None or '' -> `default` (the
    built-in three). `known`: the stacks to choose from (default: the built-ins)."""
    known = STACKS if known is None else known
    names = [n.strip() for n in (text or "").split(",") if n.strip()] or list(default or DEFAULT_STACKS)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--stacks: unknown stack(s) {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(known)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--stacks: a stack is listed twice in {text!r}")
    return [known[n] for n in names]
