"""Speculative rollback in static graphs by per-token states (``engine.cache.snapshots.StepStates``):
a verify step of 1 + k tokens per sequence keeps each sequence's state after each of its tokens
but the last, and a rejection copies the accepted one into the slot. The kernels must leave there
exactly what single-token steps leave (bit for bit in fp32), the buffers must be what
``cache_spec`` counts, and a restore must touch only the rejecting sequences' target rows."""

from __future__ import annotations

import pytest
import torch

from flashlane.cache_spec import cache_spec
from flashlane.engine.cache.pools import allocate_pools
from flashlane.engine.cache.snapshots import StepStates
from flashlane.kernels import indexer, kda, short_conv

from engine_models import small_glm

B, T = 3, 5                       # sequences, tokens per sequence (1 + 4 drafts)
SLOTS = torch.tensor([1, 3, 4])


def _rows(j: int) -> torch.Tensor:
    return torch.arange(B) * T + j


def test_kda_steps_keep_the_state_single_token_steps_leave():
    g = torch.Generator().manual_seed(0)
    h, d = 2, 8
    q, k, v = (torch.randn(B * T, h, d, generator=g) for _ in range(3))
    gate = -torch.rand(B * T, h, d, generator=g) * 0.2
    beta = torch.rand(B * T, h, generator=g)
    pool = torch.randn(6, h, d, d, generator=g)
    steps = torch.full((B + 1, T - 1, h, d, d), float("nan"))   # a bucket larger than the batch
    verified = pool.clone()
    out = kda.kda_steps(q, k, v, gate, beta, verified, SLOTS, None, T, steps)
    single = pool.clone()
    for j in range(T):
        r = _rows(j)
        o = kda.kda_decode(q[r], k[r], v[r], gate[r], beta[r], single, SLOTS)
        assert torch.equal(o, out[r])
        if j < T - 1:
            assert torch.equal(steps[:B, j], single[SLOTS])
    assert torch.equal(verified, single) and steps[B].isnan().all()


def test_short_conv_keeps_the_state_single_token_steps_leave():
    g = torch.Generator().manual_seed(1)
    c, width = 6, 3
    x = torch.randn(B * T, c, generator=g)
    weight = torch.randn(c, 1, width + 1, generator=g)
    state = torch.randn(6, c, width, generator=g)
    steps = torch.zeros(B, T - 1, c, width)
    verified = state.clone()
    short_conv.short_conv(x, weight, verified, SLOTS, torch.arange(B + 1) * T, None, steps)
    single = state.clone()
    for j in range(T - 1):
        short_conv.short_conv_decode(x[_rows(j)], weight, single, SLOTS)
        assert torch.equal(steps[:, j], single[SLOTS])


@pytest.mark.parametrize("start", [3, 4, 6])      # drafts that complete a pool, or not
def test_the_indexer_ring_is_kept_as_single_token_steps_leave_it(start):
    """Every token but a pool's last writes its ring entry when it runs alone; a verify batch
    writes only the entries of the pool still open at its end, so its per-token rings are built
    as the single steps would have left them."""
    g = torch.Generator().manual_seed(2)
    kpool, d, page = 4, 4, 8
    keys = torch.randn(B * T, d, generator=g)
    gates = torch.randn(B * T, d, generator=g)
    ape = torch.randn(kpool, d, generator=g)
    tail = torch.randn(6, kpool, 2 * d, generator=g)
    tables = torch.tensor([[1, 2], [3, 4], [5, 6]])
    starts = torch.tensor([start, start + 1, start + 2])

    def write(index_keys, ring, rows, first, count, steps=None):
        positions = (first[:, None] + torch.arange(count)).reshape(-1)
        seq = torch.arange(B).repeat_interleave(count)
        slot_mapping = tables[seq, positions // page] * page + positions % page
        indexer.write_index_keys(index_keys, keys[rows], slot_mapping=slot_mapping, page_size=page, kpool=kpool,
                                 gates=gates[rows], ape=ape, tail=ring, positions=positions, seq_of_token=seq,
                                 start_of_seq=first, ctx_of_seq=first + count, block_tables=tables,
                                 state_slots=SLOTS, tail_steps=steps)

    steps = torch.zeros(B, T - 1, kpool, 2 * d)
    write(torch.zeros(7 * page // kpool, d), tail.clone(), torch.arange(B * T), starts, T, steps)
    single = tail.clone()
    for j in range(T - 1):
        write(torch.zeros(7 * page // kpool, d), single, _rows(j), starts + j, 1)
        assert torch.equal(steps[:, j], single[SLOTS])


def test_step_states_are_what_cache_spec_counts_and_restore_only_the_target_rows():
    m = small_glm("glm5_next", mtp=True, index_kpool=4)
    spec = cache_spec(m.config, page_size=8, mtp=True)
    assert spec.kpool > 1 and spec.mtp_layers
    cache = allocate_pools(spec, 4, 6, torch.float32)
    k, size = 3, 4
    states = StepStates(cache, size, k)
    assert states.nbytes() == size * spec.verify_state_bytes_per_sequence(k, "float32") > 0
    mtp_row = spec.index_row_of[spec.mtp_layers[0]]
    assert mtp_row not in states.rows["index_tail"] and set(states.rows) == {"conv", "recurrent", "index_tail"}
    for t in states.buffers.values():
        t.copy_(torch.randn(t.shape))
    before = {name: t.clone() for name, t in cache.pools.items()}
    states.restore([2, 0], [3, 1], [5, 1])         # sequence 2 kept 3 tokens, sequence 0 kept 1
    for name, pool in cache.pools.items():
        rows = list(states.rows.get(name, ()))
        if not rows:          # the paged pools and the MTP layer's own pools
            assert torch.equal(pool, before[name])
            continue
        untouched = [s for s in range(6) if s not in (1, 5)]
        assert torch.equal(pool[:, untouched], before[name][:, untouched])
        assert torch.equal(pool[rows, 5], states.buffers[name][:, 2, 2])
        assert torch.equal(pool[rows, 1], states.buffers[name][:, 0, 0])
        other = [r for r in range(pool.shape[0]) if r not in rows]       # the MTP layer's tail
        assert torch.equal(pool[other], before[name][other])
    views = states.views({"conv": 0, "recurrent": 0, "index_tail": mtp_row, "latent": 0})
    assert set(views) == {"conv_steps", "recurrent_steps"}      # the drafter's own tail keeps nothing
