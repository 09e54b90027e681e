"""Prompts as text for a frontend that takes no token ids: the model's tokenizer both ways, and what says a
frontend refused a token-id prompt."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from replay_proxy.replay.text import Texts, TokenizerError, rejects_token_prompts
from tests.helpers import ROOT, cli


@pytest.fixture
def tokenizer_dir(tmp_path):
    """A byte-level BPE trained here on a few lines (as the suite's tiny model's is, on more)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    lines = ["the quick brown fox", "hello world one two", "one two three four", "jumps over the lazy dog"] * 20
    tokenizer.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_a_prompt_goes_to_text_and_back_to_its_tokens(tokenizer_dir):
    texts = Texts(tokenizer_dir)
    ids = texts.tokens("hello world one two")
    assert texts.text(ids) == "hello world one two" and texts.tokens(texts.text(ids)) == ids
    # Tokens that are not how the tokenizer splits the text come back otherwise: a re-tokenization to name.
    split = [t for piece in ("hel", "lo") for t in texts.tokens(piece)]
    assert texts.text(split) == "hello" and texts.tokens("hello") != split


def test_a_tokenizer_that_is_missing_or_unreadable_is_named(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer at"):
        Texts(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="is not a tokenizer"):
        Texts(tmp_path)


@pytest.mark.parametrize(("error", "refused"), [
    ('HTTP 400: {"error":{"message":"prompt: data did not match any variant of untagged enum StringOrArray"}}', True),
    ("HTTP 400: max_tokens must be at least 1", False), ("HTTP 500: prompt too long", False), (None, False),
    ('HTTP 400: {"error":{"message":"the prompt is 300 tokens, more than 256","type":"invalid_request_error"}}',
     False)])
def test_a_refused_token_prompt_is_a_400_about_the_prompt(error, refused):
    assert rejects_token_prompts(error) is refused


def test_replay_says_a_tokenizer_it_cannot_read_before_anything_starts(tmp_path):
    done = cli("replay", "--db", str(ROOT / "recordings" / "demo.db"), "--session", "demo", "--against", "frontend",
               "--upstream", "tcp://127.0.0.1:1", "--http", "http://127.0.0.1:2", "--tokenizer", str(tmp_path))
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"error: no tokenizer at {tmp_path} (a tokenizer.json, or a model folder holding one): give the model's "
        "with --tokenizer"], done.stderr
