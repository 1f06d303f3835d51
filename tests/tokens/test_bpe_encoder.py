"""tokens/bpe_encoder.py: a corpus's BPE ids are exactly the ones tokenizers gives, on text made to
break GPT-2's word pattern, across piece boundaries, and on the paths left to tokenizers."""
import json
import random

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from mingpt.tokens import bpe_encoder
from mingpt.tokens.bpe_encoder import Encoder, encode_pieces
from mingpt.tokens.tokenizer import train_bpe

TRICKY = [*"aAzZ09 '  \n\t\r.,!-_sStTmdrevlRl", "  ", "\n\n", "'s", "'re", "'ve", "'ll", "'d", "'m", "'t",
          " 's", "\n's", "\t'll", "''s", "é", "ü", "中", "Ж", "½", "²", "٣", "\u0301", "\u00a0", "\u3000",
          "\u2028", "\u0085", "\x1c", "\x0b", "😀", "𝄞", "—", "“", "\u200b", "ǅ", "ⅻ", "\U00010400"]
"""Contractions after every kind of character, whitespace runs of every kind (Unicode's, and the
control characters Python calls space but the pattern does not), letters, numbers and marks of
1 to 4 UTF-8 bytes."""


def tricky_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(TRICKY) for _ in range(n))


@pytest.fixture(scope="module")
def gpt2_style():
    """A byte-level BPE with GPT-2's pre-tokenizer, trained on tricky text (the project's recipe)."""
    rng = random.Random(0)
    tokenizer = train_bpe(iter([tricky_text(rng, 20000) for _ in range(3)]), vocab_size=600)
    return tokenizer, json.loads(tokenizer.to_str())


def theirs(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


GPT2_WORDS = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def words(text: str) -> tuple[list[str], list[str]]:
    """The words word_bounds finds in text, and those GPT-2's pre-tokenizer finds (tokenizers)."""
    data = np.frombuffer(text.encode(), np.uint8)
    bounds = bpe_encoder.word_bounds(data).tolist()
    ours = [bytes(data[a:b]).decode() for a, b in zip(bounds[:-1], bounds[1:])]
    return ours, [text[a:b] for _, (a, b) in GPT2_WORDS.pre_tokenize_str(text)]


def test_words_and_ids_are_gpt2_patterns_on_text_made_to_break_it(gpt2_style):
    tokenizer, config = gpt2_style
    rng = random.Random(1)
    encoder = Encoder(tokenizer, config)
    assert encoder.fast
    for _ in range(200):
        text = tricky_text(rng, rng.randint(1, 200))
        ours, expected = words(text)
        assert ours == expected, repr(text)
        assert encoder.encode_words(text.encode()).tolist() == theirs(tokenizer, text), repr(text)


def test_every_assigned_code_point_is_of_the_kind_tokenizers_gives_it(gpt2_style):
    """A sample of all of Unicode beside letters, numbers, punctuation and contractions; a code
    point Python's tables leave unassigned is left to tokenizers (whose tables may be newer)."""
    tokenizer, config = gpt2_style
    rng = random.Random(2)
    code_points = [c for c in range(0x80, 0x110000, 97) if not 0xD800 <= c < 0xE000]
    assigned = [c for c in code_points if bpe_encoder.char_kind(c) != bpe_encoder.UNKNOWN]
    text = "".join(rng.choice(["", " ", "a", "1", "'s", "\n", "."]) + chr(c) for c in assigned)
    ours, expected = words(text)
    assert ours == expected
    unassigned = "a1 " + chr(next(c for c in code_points if c not in assigned)) + " b"
    assert Encoder(tokenizer, config).encode(unassigned.encode()).tolist() == theirs(tokenizer, unassigned)


def test_a_text_in_chunks_encodes_as_the_whole(gpt2_style, monkeypatch):
    """Chunks cut anywhere (inside characters' bytes too), pieces cut where words end, encoded in
    two threads, come out in order; a word table that fills up starts over."""
    tokenizer, config = gpt2_style
    monkeypatch.setattr(bpe_encoder, "PIECE_BYTES", 3000)
    monkeypatch.setattr(bpe_encoder, "MAX_WORDS", 300)
    text = tricky_text(random.Random(3), 20000)
    chunks = [text[i:i + 777] for i in range(0, len(text), 777)]
    pieces = list(encode_pieces(tokenizer, config, chunks))
    assert len(pieces) > 5
    assert np.concatenate(pieces).tolist() == theirs(tokenizer, text)


def test_words_sharing_a_key_are_left_to_tokenizers(gpt2_style, monkeypatch):
    """Were two words ever to hash alike, their check tells them apart and tokenizers encodes."""
    tokenizer, config = gpt2_style
    keys = bpe_encoder.word_keys
    monkeypatch.setattr(bpe_encoder, "word_keys", lambda data, bounds: (
        np.zeros(len(bounds) - 1, np.uint64), keys(data, bounds)[1]))
    text = "the king and the queen, the king's men\n"
    assert Encoder(tokenizer, config).encode(text.encode()).tolist() == theirs(tokenizer, text)


def llama3_style(texts: list[str]) -> Tokenizer:
    """A byte-level BPE of another split pattern (a regex Split, then bytes): not GPT-2's words."""
    tokenizer = Tokenizer(models.BPE())
    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


@pytest.mark.parametrize("kind", ["another split pattern", "an added token in the text"])
def test_what_the_fast_path_cannot_read_is_tokenizers_own(gpt2_style, kind, monkeypatch):
    monkeypatch.setattr(bpe_encoder, "PIECE_BYTES", 2000)
    text = tricky_text(random.Random(4), 6000)
    if kind == "another split pattern":
        tokenizer = llama3_style([text])
    else:
        tokenizer = Tokenizer.from_str(gpt2_style[0].to_str())
        tokenizer.add_special_tokens(["<|endoftext|>"])
        text = text[:3000] + "<|endoftext|>" + text[3000:]
    config = json.loads(tokenizer.to_str())
    assert Encoder(tokenizer, config).fast == (kind != "another split pattern")
    ids = np.concatenate(list(encode_pieces(tokenizer, config, [text]))).tolist()
    assert ids == theirs(tokenizer, text)
