"""lm-eval's own ``local-completions`` model against `flashlane serve` (prefix cache on): its
loglikelihood and loglikelihood_rolling requests equal the same token windows scored offline
through LLM.score. lm-eval finds the server's tokenizer by itself (/tokenizer_info, /tokenize)."""

from __future__ import annotations

import pytest
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from flashlane import LLM

from engine_models import preset
from server_harness import ENGINE_ARGS, LiveServer

MODEL = "tiny-flash"
TOL = 1e-4
CONTEXT = "Question: which part of the engine keeps pages that many requests share? Answer:"
CHOICES = [" the prefix cache", " the scheduler", " the tokenizer", " a page table of the sampler"]
ROLLING = ("A long document is scored in windows: each window after the first is conditioned on the "
           "tokens before it, up to the model's length, and the log-likelihoods of all windows add up.")
MAX_LENGTH = 33   # lm-eval keeps one token for generation: windows of 32, so ROLLING takes several


@pytest.fixture(scope="module")
def loaded():
    return preset(MODEL)


@pytest.fixture(scope="module")
def lm(loaded):
    with LiveServer(loaded, MODEL) as srv:
        yield LocalCompletionsAPI(base_url=f"{srv.url}/v1/completions", model=MODEL, tokenizer_backend="auto",
                                  tokenized_requests=True, batch_size=2, max_retries=1, max_length=MAX_LENGTH)


@pytest.fixture(scope="module")
def llm(loaded):
    return LLM(loaded, **{**ENGINE_ARGS, "enable_prefix_caching": False})


def _offline(llm, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """Sum of the continuation's logprobs and whether it is the greedy continuation."""
    rows = llm.score([context + continuation])[0][len(context) - 1:]
    picked = [rows[i, t].item() for i, t in enumerate(continuation)]
    return sum(picked), all(rows[i].argmax().item() == t for i, t in enumerate(continuation))


def test_the_server_tokenizer_is_what_lm_eval_uses(lm, loaded):
    assert lm.tokenizer_backend == "remote"
    assert lm.tok_encode(CONTEXT) == loaded.tokenizer.encode(CONTEXT, add_special_tokens=False)


def test_loglikelihood_equals_offline_scores_also_when_the_context_is_cached(lm, llm):
    # every choice shares the context, so after the first the context's pages are in the cache
    requests = [Instance("loglikelihood", {}, (CONTEXT, c), i) for i, c in enumerate(CHOICES * 2)]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    assert len(got) == len(requests)
    for (ll, greedy), choice in zip(got, CHOICES * 2):
        want_ll, want_greedy = _offline(llm, *lm._encode_pair(CONTEXT, choice))
        assert abs(ll - want_ll) <= TOL and greedy == want_greedy


def test_loglikelihood_rolling_equals_offline_windows(lm, llm):
    ids = lm.tok_encode(ROLLING)
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
        token_list=ids, prefix_token=lm.prefix_token_id, max_seq_len=MAX_LENGTH - 2, context_len=1)]
    assert len(windows) >= 2
    want = sum(_offline(llm, ctx, cont)[0] for ctx, cont in windows)
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (ROLLING,), 0)], disable_tqdm=True)
    assert abs(got - want) <= TOL
