"""N-gram prompt lookup: the continuation of the latest earlier occurrence of the request's last
n tokens (longest n first). Agentic replays repeat tool outputs, file contents and code, so the
request's own tokens predict much of what it is about to write."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramDrafter:
    def __init__(self, num_tokens: int, n_min: int = 1, n_max: int = 4):
        self.num_tokens = num_tokens
        self.n_min = n_min
        self.n_max = n_max

    lookahead = 0      # drafts come from the request's own tokens: nothing to reserve ahead

    def draft(self, req, limit: int) -> list[int]:
        """The scheduler's entry point (the MTP drafter has the same)."""
        return self.propose(req.all_token_ids, limit)

    def propose(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """Up to ``min(num_tokens, limit)`` draft tokens to follow ``tokens`` (none without a match)."""
        want = self.num_tokens if limit is None else min(self.num_tokens, limit)
        length = len(tokens)
        if want <= 0 or length < self.n_min + 1:
            return []
        ids = np.asarray(tokens, dtype=np.int64)
        # windows that end before the last token, so each has at least one continuation token
        earlier = ids[:-1]
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            windows = sliding_window_view(earlier, n)
            hits = np.flatnonzero((windows == ids[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start: start + want].tolist()
        return []
