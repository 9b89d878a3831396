"""The CUDA backend: KDA through fla-core's Triton kernels, the other ops as the plain-torch backend
runs them (on CUDA tensors).

Mapping onto fla (``fla.ops.kda``, read from fla-core 0.6):

* layouts are the same: fla's q, k, g are ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``
  (post-sigmoid), g the per-channel log-decay, and its state ``[N, H, K, V]`` fp32 -- our
  ``[slots, H, Dk, Dv]`` rows, so no transpose (``state_v_first=False``);
* our kernels L2-normalise q and k (eps 1e-6 inside the sqrt) and then scale q by ``Dk**-0.5``:
  fla's ``use_qk_l2norm_in_kernel=True`` with ``scale=Dk**-0.5`` does the same;
* a decode step of B sequences is fla's equal-length form ``[B, 1, H, D]``; the prefill chunks of
  a step are one varlen call (``[1, N, H, D]`` plus ``cu_seqlens``); initial states are gathered
  from the slots, zeroed for fresh sequences (first new token at position 0, as the cpu backend
  decides it), and the final states written back to the same slots.

fla is imported on first use (it takes seconds), so choosing a backend stays cheap; the decode step
is a ``torch.library`` custom op, so a compiled (CUDA-graph) decode graph calls it as one opaque node.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import itertools

import torch

from ..cpu import CpuBackend
from ..cpu.backend import fresh_sequences

PIP_EXTRA = "pip install 'flashlane[cuda]'"


def fla_version() -> str | None:
    """The installed fla-core (or flash-linear-attention) version, without importing it."""
    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.cache
def _fla_not_found() -> str | None:
    """What of fla's KDA kernels is not installed (None: both packages are there)."""
    for module, what in (("fla", "fla-core"), ("triton", "triton")):
        if importlib.util.find_spec(module) is None:
            return f"{what} (the optional package of the KDA kernels; not installed: {PIP_EXTRA})"
    return None


@functools.cache
def _fla_import_error() -> str | None:
    """Why ``fla.ops.kda`` does not import (None: it does). Tried once per process."""
    try:
        import fla.ops.kda  # noqa: F401
    except Exception as exc:   # a broken install or a triton that does not fit this torch
        return f"a working fla-core (fla-core {fla_version()} does not import: {type(exc).__name__}: {exc})"
    return None


def cuda_missing(device: torch.device | str) -> str | None:
    """None when the cuda backend runs on ``device``, else what is missing, every piece named."""
    dev = torch.device(device)
    missing = []
    if not torch.cuda.is_available():
        missing.append(f"a CUDA GPU (torch {torch.__version__} sees none)")
    elif dev.type != "cuda":
        missing.append(f"a CUDA device (the engine device is {dev}: pass --device cuda)")
    fla = _fla_not_found()
    if fla is None and not missing:
        fla = _fla_import_error()      # importing only where it would be used
    if fla is not None:
        missing.append(fla)
    return "it needs " + " and ".join(missing) if missing else None


def _fla_decode_impl(q, k, v, g, beta, state_pool, slots, fresh):
    from fla.ops.kda import fused_recurrent_kda

    init = state_pool.index_select(0, slots).float().masked_fill_(fresh.view(-1, 1, 1, 1), 0.0)
    o, final = fused_recurrent_kda(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1),
                                   beta.unsqueeze(1), scale=q.shape[-1] ** -0.5, initial_state=init,
                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    state_pool.index_copy_(0, slots, final.to(state_pool.dtype))
    return o.squeeze(1).to(v.dtype).clone()      # a fresh tensor: a custom op's output may not alias


@torch.library.custom_op("flashlane::fla_kda_decode", mutates_args=("state_pool",))
def fla_kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state_pool: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """``kernels.kda.kda_decode`` (same arguments, ``fresh`` required) through fla's
    ``fused_recurrent_kda``: one step of B sequences, their states updated in ``state_pool[slots]``."""
    return _fla_decode_impl(q, k, v, g, beta, state_pool, slots, fresh)


@fla_kda_decode.register_fake
def _(q, k, v, g, beta, state_pool, slots, fresh):
    return torch.empty_like(v)


def _chunk_kda(*args, **kwargs):
    from fla.ops.kda import chunk_kda

    return chunk_kda(*args, **kwargs)


class CudaBackend(CpuBackend):
    """fla-core's ``chunk_kda`` (prefill chunks) and ``fused_recurrent_kda`` (decode) for KDA;
    sparse MLA, the indexer, attention and the FFN ops stay plain torch (correct before fast)."""

    name = "cuda"
    # fla's varlen chunked kernel; an attribute so the CPU test can put fla's fused_recurrent_kda
    # (same call, same math, runs in Triton's interpreter) in its place: chunk_kda needs a GPU
    prefill_kernel = staticmethod(_chunk_kda)

    def describe(self) -> str:
        return (f"{self.name}: fla-core {fla_version()} (chunk_kda prefill, fused_recurrent_kda decode), "
                f"plain-torch kernels for the other ops on {self.device}")

    def kda(self, q, k, v, g, beta, rec_state, meta, steps=None):
        slots, fresh = meta.state_slots, fresh_sequences(meta)
        if meta.is_decode:
            return fla_kda_decode(q, k, v, g, beta, rec_state, slots, fresh)
        if meta.static:        # a static verify batch (no host lists): the plain-torch steps
            return super().kda(q, k, v, g, beta, rec_state, meta, steps)
        return self._kda_mixed(q, k, v, g, beta, rec_state, slots, fresh, meta)

    def _kda_mixed(self, q, k, v, g, beta, rec_state, slots, fresh, meta):
        """As the cpu backend's mixed step: the decode tokens as one batched decode step (so their
        numbers do not depend on the prefills beside them), all prefill chunks in one varlen call.
        Token indices come from the host lists (no device-to-host sync)."""
        dev = q.device
        cu = [0, *itertools.accumulate(meta.q_lens)]
        out = torch.empty_like(v)
        decode = [b for b, ql in enumerate(meta.q_lens) if ql == 1]
        if decode:
            seqs = torch.tensor(decode, dtype=torch.long).to(dev)
            tok = torch.tensor([cu[b] for b in decode], dtype=torch.long).to(dev)
            out[tok] = fla_kda_decode(q[tok], k[tok], v[tok], g[tok], beta[tok], rec_state, slots[seqs], fresh[seqs])
        prefill = [b for b, ql in enumerate(meta.q_lens) if ql > 1]
        if prefill:
            tok = torch.cat([torch.arange(cu[b], cu[b + 1]) for b in prefill]).to(dev)
            cu_cpu = torch.tensor([0, *itertools.accumulate(meta.q_lens[b] for b in prefill)], dtype=torch.long)
            seqs = torch.tensor(prefill, dtype=torch.long).to(dev)
            rows = slots[seqs]
            init = rec_state.index_select(0, rows).float().masked_fill_(fresh[seqs].view(-1, 1, 1, 1), 0.0)
            o, final = self.prefill_kernel(
                q[tok].unsqueeze(0), k[tok].unsqueeze(0), v[tok].unsqueeze(0), g[tok].unsqueeze(0),
                beta[tok].unsqueeze(0), scale=q.shape[-1] ** -0.5, initial_state=init, output_final_state=True,
                use_qk_l2norm_in_kernel=True, cu_seqlens=cu_cpu.to(dev), cu_seqlens_cpu=cu_cpu)
            out[tok] = o[0].to(v.dtype)
            rec_state.index_copy_(0, rows, final.to(rec_state.dtype))
        return out


__all__ = ["CudaBackend", "PIP_EXTRA", "cuda_missing", "fla_version", "fla_kda_decode"]
