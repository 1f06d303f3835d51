"""tokens/tokenizer.py: the BPE trained on a text, a tokenizer.json read (or refused in one line), and
the Vocabulary a snapshot keeps."""
import pytest
from helpers import make_text
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from mingpt.common.errors import DataError
from mingpt.tokens.tokenizer import Vocabulary, read_tokenizer_file, sample_windows, train_bpe, window_text


def test_training_is_deterministic_and_round_trips_any_text():
    """Two trainings (two hash seeds: tokenizers' maps are seeded per instance) give one tokenizer,
    so the machines of a job make the same one; any text, unseen characters too, comes back."""
    texts = [make_text(20000, seed) for seed in range(3)]
    first, second = (train_bpe(iter(texts), vocab_size=300) for _ in range(2))
    assert first.to_str() == second.to_str() and first.get_vocab_size() == 300
    vocabulary = Vocabulary.from_json(first.to_str())
    text = "ROMEO: naïve 𝄞 中文\n\tthe king's men  "
    assert vocabulary.decode(vocabulary.encode(text)) == text
    assert len(vocabulary) == 300 and vocabulary[vocabulary.encode(" king")[0]].startswith("Ġ")


def test_a_list_of_characters_is_a_character_vocabulary():
    vocabulary = Vocabulary.of(list("abc"))
    assert vocabulary.is_char and vocabulary.decode([2, 0]) == "ca"
    assert Vocabulary.of(vocabulary) is vocabulary


def test_the_sample_is_spread_over_the_text_in_whole_words():
    windows = sample_windows(10_000_000, 640_000)
    assert len(windows) == 64 and sum(length for _, length in windows) == 640_000
    assert all(i * 156_250 <= offset < (i + 1) * 156_250 for i, (offset, _) in enumerate(windows))
    assert sample_windows(1000, 640_000) == [(0, 1000)]
    assert window_text("ng, the king\nof ".encode(), whole=False) == " the king\nof "
    assert window_text("é".encode()[1:] + b" abc", whole=True) == " abc"  # a character cut at the edge


def word_level(path):
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer.save(str(path))


def bpe_on_whitespace(path):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([make_text(2000)], trainers.BpeTrainer(vocab_size=100, show_progress=False))
    tokenizer.save(str(path))


@pytest.mark.parametrize("case, make, said", [
    ("missing", None, "no such file {path}; give char, bpe"),
    ("corrupt", lambda path: path.write_text('{"model": '), "{path} is not a tokenizers tokenizer.json"),
    ("not a tokenizer", lambda path: path.write_text('{"a": 1}'),
     "{path} is not a tokenizers tokenizer.json"),
    ("word level", word_level, "{path} is a WordLevel model, not a byte-level BPE"),
    ("bpe of characters", bpe_on_whitespace, "{path} is a BPE without a ByteLevel pre-tokenizer or decoder"),
])
def test_a_bad_tokenizer_json_is_refused_naming_the_key(tmp_path, case, make, said):
    path = tmp_path / "tokenizer.json"
    if make:
        make(path)
    with pytest.raises(DataError) as error:
        read_tokenizer_file(str(path))
    assert str(error.value).startswith("data_config.tokenizer: " + said.format(path=path))
    assert "\n" not in str(error.value)
