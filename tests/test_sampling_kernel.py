import torch

from flashlane.kernels.sampling import sample, topk_logprobs


def _run(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, n=200):
    b = logits.shape[0]
    out = []
    for u in torch.linspace(0, 0.999, n):
        out.append(sample(logits, torch.full((b,), temperature), torch.full((b,), top_k, dtype=torch.long),
                          torch.full((b,), top_p), torch.full((b,), min_p), torch.full((b,), float(u))))
    return torch.stack(out)


def test_greedy_rows_take_argmax():
    logits = torch.randn(4, 50)
    assert torch.equal(_run(logits, temperature=0.0, n=3)[0], logits.argmax(-1))


def test_top_k_top_p_min_p_restrict_support():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    order = logits.argsort(-1, descending=True)
    picks = _run(logits, top_k=5)
    for row in range(3):
        assert set(picks[:, row].tolist()) <= set(order[row, :5].tolist())
        assert len(set(picks[:, row].tolist())) > 1
    probs = logits.softmax(-1)
    picks = _run(logits, top_p=0.3)
    for row in range(3):
        sorted_p = probs[row, order[row]]
        keep = int((torch.cumsum(sorted_p, 0) - sorted_p < 0.3).sum())
        assert set(picks[:, row].tolist()) <= set(order[row, :keep].tolist())
    picks = _run(logits, min_p=0.5)
    for row in range(3):
        allowed = (probs[row] >= 0.5 * probs[row].max()).nonzero().squeeze(1).tolist()
        assert set(picks[:, row].tolist()) <= set(allowed)
    assert torch.equal(_run(logits, min_p=1.0, n=5)[0], logits.argmax(-1))


def test_inverse_cdf_matches_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    picks = _run(logits, n=10000)[:, 0]
    freq = torch.bincount(picks, minlength=3).float() / picks.numel()
    assert torch.allclose(freq, logits.softmax(-1)[0], atol=0.01)


def test_topk_logprobs_include_chosen():
    lp = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), -1)
    rows = topk_logprobs(lp, torch.tensor([3]), 2)
    assert set(rows[0]) == {0, 1, 3}
    assert abs(rows[0][3] - lp[0, 3].item()) < 1e-6


def _reference_probs(logits, temperature, top_k, top_p, min_p):
    """The kept distribution by a full sort of the vocabulary (the definition)."""
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_p, order = probs.sort(descending=True)
    mass_before = torch.cumsum(sorted_p, 0) - sorted_p
    keep = mass_before < top_p
    if top_k > 0:
        keep &= torch.arange(probs.numel()) < top_k
    keep &= sorted_p >= min_p * sorted_p[0]
    keep[0] = True
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_p[keep]
    return out / out.sum()


def test_truncated_rows_keep_exactly_the_tokens_a_full_sort_keeps_whichever_top_n_holds_them():
    from flashlane.kernels.sampling import PARTIAL_SORTS, sampling_probs

    torch.manual_seed(3)
    vocab = 3000
    assert PARTIAL_SORTS[-1] < vocab
    peaked, flat = torch.randn(vocab) * 8, torch.randn(vocab) * 0.5
    # (logits, top_k, top_p, min_p): within the top 64, within the top 1,024, only in a full sort
    rows = [(peaked, 20, 1.0, 0.0), (peaked, -1, 0.9, 0.0), (peaked, -1, 1.0, 0.01), (flat, 500, 1.0, 0.0),
            (flat, -1, 0.2, 0.0), (flat, -1, 0.95, 0.0), (flat, -1, 1.0, 0.05), (flat, 2000, 0.99, 0.0)]
    for logits, k, p, m in rows:
        got = sampling_probs(logits[None], torch.tensor([0.8]), torch.tensor([k]), torch.tensor([p]),
                             torch.tensor([m]))[0]
        want = _reference_probs(logits, 0.8, k, p, m)
        assert torch.equal(got > 0, want > 0), (k, p, m)
        assert torch.allclose(got, want, atol=1e-6), (k, p, m)
    # all rows of one batch: each as alone
    batch = torch.stack([r[0] for r in rows])
    args = [torch.full((len(rows),), 0.8), torch.tensor([r[1] for r in rows]),
            torch.tensor([r[2] for r in rows]), torch.tensor([r[3] for r in rows])]
    together = sampling_probs(batch, *args)
    for i, (logits, k, p, m) in enumerate(rows):
        assert torch.allclose(together[i], _reference_probs(logits, 0.8, k, p, m), atol=1e-6)


def test_plain_truncated_and_greedy_rows_of_one_batch_sample_as_each_would_alone():
    torch.manual_seed(4)
    vocab = 5000
    logits = torch.randn(4, vocab) * 4
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.3])
    top_k, top_p = torch.tensor([-1, 40, -1, -1]), torch.tensor([1.0, 1.0, 1.0, 0.8])
    min_p = torch.zeros(4)
    for u in torch.linspace(0, 0.999, 25):
        uniforms = torch.full((4,), float(u))
        together = sample(logits, temperature, top_k, top_p, min_p, uniforms)
        for i in range(4):
            alone = sample(logits[i: i + 1], temperature[i: i + 1], top_k[i: i + 1], top_p[i: i + 1],
                           min_p[i: i + 1], uniforms[i: i + 1])
            assert together[i] == alone[0]
        assert together[2] == logits[2].argmax()
        assert logits[1].argsort(descending=True)[:40].eq(together[1]).any()


def test_a_plain_row_never_picks_a_token_of_zero_probability_and_follows_its_distribution():
    logits = torch.full((1, 2000), -float("inf"))
    logits[0, [7, 900, 1999]] = torch.tensor([0.0, 1.0, 2.0])
    picks = _run(logits, n=6000)[:, 0]
    assert set(picks.tolist()) == {7, 900, 1999}
    freq = torch.bincount(picks, minlength=2000)[[7, 900, 1999]].float() / picks.numel()
    assert torch.allclose(freq, torch.tensor([0.0, 1.0, 2.0]).softmax(-1), atol=0.01)
