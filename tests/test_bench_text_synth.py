import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from flashlane.bench.text_synth import FALLBACK_WORDS, TextSynth, load_tokenizer, single_token_words


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [" ".join(FALLBACK_WORDS[i:] + FALLBACK_WORDS[:i]) for i in range(0, 200, 7)]
    tok.train_from_iterator(corpus, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_text_is_deterministic_per_key_and_seed():
    s = TextSynth(seed=1)
    assert s.text(50, "a", 1) == TextSynth(seed=1).text(50, "a", 1)
    assert s.text(50, "a", 1) != s.text(50, "a", 2)
    assert s.text(50, "a", 1) != TextSynth(seed=2).text(50, "a", 1)
    assert s.text(0, "x") == ""
    assert s.count(s.text(37, "k")) == 37  # the approximation counts words
    assert not s.exact


def test_exact_token_lengths_with_a_tokenizer(bpe):
    tok = load_tokenizer(str(bpe))
    words = single_token_words(tok)
    assert len(words) > 20
    s = TextSynth(seed=0, tokenizer=tok)
    assert s.exact
    for n in (1, 7, 64, 300):
        text = s.text(n, "p", n)
        assert len(tok.encode(text, add_special_tokens=False).ids) == n
        assert s.count(text) == n
    assert load_tokenizer(str(bpe.parent)) is not None  # a folder holding tokenizer.json


def test_nonce_and_bad_tokenizer_spec(tmp_path):
    n = TextSynth.nonce(1, "c1", "t3", "root")
    assert n.startswith("[rid:") and len(n) == 18 and n == TextSynth.nonce(1, "c1", "t3", "root")
    assert n != TextSynth.nonce(1, "c2", "t3", "root")
    assert load_tokenizer(None) is None
    with pytest.raises(ValueError, match="tokenizer"):
        load_tokenizer(str(tmp_path / "nothing-here"))


def test_a_name_is_resolved_by_the_callers_resolver_only(bpe):
    """The bench reads tokenizers by path; a name (e.g. a flashlane preset) goes through the
    caller's resolver, never through an import of flashlane.presets."""
    asked = []

    def resolve(name):
        asked.append(name)
        return str(bpe.parent) if name == "my-preset" else None

    assert load_tokenizer("my-preset", resolve).get_vocab_size() == Tokenizer.from_file(str(bpe)).get_vocab_size()
    with pytest.raises(ValueError, match="tokenizer: 'other'"):
        load_tokenizer("other", resolve)
    assert asked == ["my-preset", "other"]
    with pytest.raises(ValueError, match="tokenizer: 'my-preset'"):
        load_tokenizer("my-preset")  # no resolver: a name is not a path
    assert load_tokenizer(str(bpe), resolve) is not None and asked == ["my-preset", "other"]  # paths: no lookup
