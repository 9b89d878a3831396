"""Serving stacks: named, reproducible sets of `flashlane serve` flags that `compare` runs each
model under, so it can reproduce the public finding (Flash slower per task) and show what closes it.

A stack gives flags by model *role*: `hybrid` (linear-attention layers, GLM-5.3-Flash class) or
`standard` (attention in every layer, GLM-5.3 class). Which target has which role is decided by
the caller (compare: from the model's config when it can read one, else A = hybrid, B = standard).
Eager execution (no `--compile`) is the engine default, so no stack passes it.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("hybrid", "standard")


@dataclass(frozen=True)
class Stack:
    name: str
    description: str
    hybrid: tuple[str, ...]
    standard: tuple[str, ...]
    mechanism: str = ""  # what this stack does that the others do not, for the answer line

    def flags(self, role: str) -> list[str]:
        if role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
        return list(self.hybrid if role == "hybrid" else self.standard)


NAIVE_FLAGS = ("--scheduler", "static", "--static-batch-size", "32", "--no-enable-prefix-caching")
# Continuous batching and prefix caching are engine defaults; the dynamic batching window is not.
FLASHLANE_FLAGS = ("--enable-prefix-caching", "--max-wait-ms", "2")

STACKS: dict[str, Stack] = {s.name: s for s in (
    Stack("naive", "fixed batches of up to 32 requests in arrival order, each run to completion "
                   "before the next is admitted; no prefix cache; eager", NAIVE_FLAGS, NAIVE_FLAGS,
          "no prefix cache for either model, static batches"),
    Stack("hybrid-cache-gap", "the state of public stacks: prefix caching works for the standard "
                              "model, not for the hybrid", ("--no-enable-prefix-caching",),
          ("--enable-prefix-caching",), "a prefix cache for the standard model only"),
    Stack("flashlane", "continuous batching, prefix cache with state checkpoints for the hybrid, "
                       "2 ms dynamic batching window", FLASHLANE_FLAGS, FLASHLANE_FLAGS,
          "prefix caching for the hybrid too (state checkpoints restore its linear-attention state)"),
)}
DEFAULT_STACKS = ("naive", "hybrid-cache-gap", "flashlane")


def parse_stacks(text: str | None) -> list[Stack]:
    """'naive,flashlane' -> those stacks, in the order given; None or '' -> the default three."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()] or list(DEFAULT_STACKS)
    unknown = [n for n in names if n not in STACKS]
    if unknown:
        raise ValueError(f"--stacks: unknown stack(s) {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(STACKS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--stacks: a stack is listed twice in {text!r}")
    return [STACKS[n] for n in names]
