"""Optional torch.compile of small pure-tensor kernels.

On CPU the mHC weights (sigmoid/softmax plus 39 Sinkhorn normalisations of an n x n matrix per
token) cost ~150 dispatches per site; their math is negligible. Compiled, each site becomes a
few fused loops. One compiled function is shared by every caller (dynamic token count).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def compiled(fn):
    return torch.compile(fn, dynamic=True)
