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
