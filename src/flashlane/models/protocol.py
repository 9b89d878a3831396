"""What the loader and the engine need from a model class, as typing protocols.

Every model is a ``CausalLM``: flattened tokens of a mixed batch in, hidden states out, logits
for chosen rows. The other protocols are optional abilities; the loader and the engine check
them with ``isinstance`` / ``issubclass`` instead of probing attribute names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from ..config import ModelConfig
    from .forward_batch import ForwardBatch


@runtime_checkable
class CausalLM(Protocol):
    def forward(self, batch: "ForwardBatch") -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of every token in the batch."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of the given hidden-state rows."""


@runtime_checkable
class PostLoad(Protocol):
    def post_load(self) -> None:
        """Derive what the weights imply (absorbed projections, caches) once they are loaded."""


@runtime_checkable
class Compilable(Protocol):
    def set_compile(self, on: bool) -> None:
        """Run the model's compilable pieces through torch.compile (on) or eagerly (off)."""


@runtime_checkable
class KeepsFp32Params(Protocol):
    """Parameters and buffers whose name contains one of these stay float32 whatever the dtype."""

    keep_fp32_params: tuple[str, ...]


@runtime_checkable
class OptionalMtp(Protocol):
    """A class whose multi-token-prediction block can be left out: its constructor takes
    ``with_mtp``, and it says whether a checkpoint's tensor names carry that block."""

    @staticmethod
    def checkpoint_has_mtp(cfg: "ModelConfig", names: Iterable[str]) -> bool: ...


@runtime_checkable
class MtpDrafter(Protocol):
    """A model that can draft with its own next-token-prediction layer (spec §1.10)."""

    with_mtp: bool

    def mtp(self, batch: "ForwardBatch", hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer over ``batch`` (whose ``input_ids`` are each position's next token) and the
        previous hidden states [N, H]; returns its normed output [N, H] (logits: ``compute_logits``)."""


def fp32_param_names(model, default: tuple[str, ...]) -> tuple[str, ...]:
    """The name fragments ``model`` keeps in float32 (``default`` when it declares none)."""
    return tuple(model.keep_fp32_params) if isinstance(model, KeepsFp32Params) else default
