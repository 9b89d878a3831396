"""Causal depthwise short convolution + SiLU over flattened mixed batches, with a conv state.

The conv state of a sequence is the last ``K-1`` *pre-conv* inputs, ``[C, K-1]`` (oldest first),
stored at ``conv_state[slot]``. Output of token ``t``, channel ``c``:
``SiLU( sum_m w[c, m] * z[t-K+1+m, c] )`` with ``z`` before the sequence start taken from the
state (zeros for a fresh sequence). Math is fp32 (the reference keeps the conv weight in fp32);
the output has the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> None:
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    if x.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"short_conv: x {tuple(x.shape)} must be [N, C] with C = weight rows {weight.shape[0]}")
    if conv_state.shape[1:] != (x.shape[1], weight.shape[-1] - 1):
        raise ValueError(f"short_conv: conv_state {tuple(conv_state.shape)} must be [slots, {x.shape[1]}, "
                         f"{weight.shape[-1] - 1}]")


def _weight(weight: torch.Tensor) -> torch.Tensor:
    """[C, 1, K] (nn.Conv1d layout) or [C, K] -> fp32 [C, K]."""
    return (weight.squeeze(1) if weight.dim() == 3 else weight).float()


def short_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
               cu_q: torch.Tensor, fresh: torch.Tensor | None = None,
               steps_out: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen causal conv: sequence ``b`` owns rows ``cu_q[b]:cu_q[b+1]`` of ``x`` [N, C] and state
    ``conv_state[slots[b]]`` [C, K-1], which is read, then overwritten with its newest K-1 inputs.

    ``fresh`` [B] bool: sequences starting at position 0 (their slot content is ignored).
    ``steps_out`` [>= B, S, C, K-1], only where every sequence has S + 1 new rows (a static verify
    step): the state after each of its first S tokens is written there as well.
    """
    _check(x, weight, conv_state)
    w = _weight(weight)
    width = w.shape[1] - 1
    num_seqs = slots.numel()
    q_lens = cu_q[1:] - cu_q[:-1]
    history = conv_state.index_select(0, slots).transpose(1, 2)               # [B, K-1, C]
    if fresh is not None:
        history = history.masked_fill(fresh.view(-1, 1, 1), 0)
    # One buffer holding, per sequence, its K-1 history rows followed by its new rows.
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs, device=x.device), q_lens, output_size=x.shape[0])
    row_in_seq = torch.arange(x.shape[0], device=x.device) - cu_q[seq_of_row]
    new_rows = cu_q[seq_of_row] + seq_of_row * width + width + row_in_seq
    hist_rows = (cu_q[:-1] + torch.arange(num_seqs, device=x.device) * width).unsqueeze(1) \
        + torch.arange(width, device=x.device)
    buf = x.new_empty(x.shape[0] + num_seqs * width, x.shape[1], dtype=torch.float32)
    buf[new_rows] = x.float()
    buf[hist_rows.reshape(-1)] = history.reshape(-1, x.shape[1]).float()
    acc = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    first = new_rows - width
    for m in range(width + 1):
        acc += buf[first + m] * w[:, m]
    # newest K-1 rows of each sequence's segment become its state
    tail_rows = (cu_q[1:] + torch.arange(num_seqs, device=x.device) * width).unsqueeze(1) \
        + torch.arange(width, device=x.device)
    conv_state.index_copy_(0, slots, buf[tail_rows.reshape(-1)].view(num_seqs, width, -1)
                           .transpose(1, 2).to(conv_state.dtype))
    if steps_out is not None:
        # after token j of a segment, the state is its rows j+1 .. j+K-1 (history first)
        steps = steps_out.shape[1]
        rows = ((cu_q[:-1] + torch.arange(num_seqs, device=x.device) * width)[:, None, None]
                + torch.arange(1, steps + 1, device=x.device)[None, :, None] + torch.arange(width, device=x.device))
        steps_out[:num_seqs] = buf[rows.reshape(-1)].view(num_seqs, steps, width, -1).transpose(2, 3) \
            .to(steps_out.dtype)
    return F.silu(acc).to(x.dtype)


def short_conv_decode(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                      fresh: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per sequence: ``x`` [B, C] with states ``conv_state[slots]`` (updated in place)."""
    _check(x, weight, conv_state)
    w = _weight(weight)
    history = conv_state.index_select(0, slots)
    if fresh is not None:
        history = history.masked_fill(fresh.view(-1, 1, 1), 0)
    window = torch.cat([history.float(), x.float().unsqueeze(-1)], dim=-1)   # [B, C, K]
    conv_state.index_copy_(0, slots, window[..., 1:].to(conv_state.dtype))
    return F.silu((window * w).sum(-1)).to(x.dtype)


__all__ = ["short_conv", "short_conv_decode"]
