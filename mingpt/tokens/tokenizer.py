"""What turns the text into token ids and back: its characters (the original's), or a byte-level BPE.

`data_config.tokenizer` chooses (TokenizerChoice):
- `char`: one token per character of the text, as the original;
- `bpe`: a byte-level BPE (GPT-2's kind) trained on the text itself by Hugging Face `tokenizers`,
  with at most `bpe_vocab_size` tokens, from a sample of `bpe_sample_mb` MB spread evenly over the
  text (training on all of a large corpus would take longer than encoding it; the merges of a few
  thousand tokens are settled by a few MB);
- a path (local or any fsspec URL) of a `tokenizer.json` in the Hugging Face `tokenizers` format
  holding a byte-level BPE: GPT-2's, or any other. Nothing is ever downloaded.

The tokenizer is made once per corpus, with its token file (token_file.py), and kept in the token
file's header; a snapshot keeps it too (its Vocabulary), so generate.py and export_hf.py decode what
a BPE model writes without the corpus.
"""
import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Iterator, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mingpt.common import files
from mingpt.common.errors import DataError, check, short_reason

CHAR, BPE = "char", "bpe"
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_SAMPLE_MB = 8.0
BYTE_ALPHABET = 256
"""A byte-level BPE starts from one token per byte."""
MAX_VOCAB = 2**32
"""Token files keep ids as uint32 at most."""
BPE_TRAINING = 1
"""The version of train_bpe's recipe: a token file made by another one is made again."""
MIN_FREQUENCY = 2
"""A pair seen once in the sample is no merge worth a token."""
SAMPLE_WINDOWS = 64
"""The sample is this many windows of the text, evenly spaced."""
TOKENIZER_KEY = "data_config.tokenizer"


def check_settings(tokenizer: str, vocab_size: int, sample_mb: float) -> None:
    """data_config's tokenizer keys (DataConfig's, and prepare_data.py's options) in range."""
    check(bool(tokenizer), "data_config.tokenizer",
          "must not be empty; give char, bpe or the path of a tokenizer.json")
    check(BYTE_ALPHABET < vocab_size <= MAX_VOCAB, "data_config.bpe_vocab_size",
          f"must be more than the {BYTE_ALPHABET} byte tokens and at most {MAX_VOCAB:,} (uint32 ids), "
          f"got {vocab_size}")
    check(sample_mb > 0, "data_config.bpe_sample_mb", f"must be positive, got {sample_mb}")


@dataclass(frozen=True)
class TokenizerChoice:
    """What data_config asks for: CHAR, BPE (trained on the text), or a tokenizer.json's path."""

    name: str = CHAR
    vocab_size: int = DEFAULT_VOCAB_SIZE
    """BPE: at most this many tokens (the text may give fewer merges)."""
    sample_bytes: int = int(DEFAULT_SAMPLE_MB * 1e6)
    """BPE: train on this many bytes of the text."""
    characters: str = ""
    """CHAR for a set of texts: the set's characters, sorted, every file's ids of this one vocabulary
    (text_set.py counts them); empty: a text's own characters."""

    @classmethod
    def of(cls, tokenizer: str, vocab_size: int, sample_mb: float) -> "TokenizerChoice":
        check_settings(tokenizer, vocab_size, sample_mb)
        return cls(tokenizer, vocab_size, int(sample_mb * 1e6))

    @property
    def is_char(self) -> bool:
        return self.name == CHAR

    @cached_property
    def file(self) -> Optional["TokenizerFile"]:
        """A tokenizer.json's content, read (and checked) once."""
        return None if self.name in (CHAR, BPE) else read_tokenizer_file(self.name)

    def settings(self) -> dict:
        """What made the token file's tokenizer: a token file made with other settings is stale."""
        if self.is_char:
            if self.characters:  # a digest: a set's vocabulary may be thousands of characters
                return {"kind": CHAR, "characters": hashlib.sha256(self.characters.encode()).hexdigest()[:16]}
            return {"kind": CHAR}
        if self.file is not None:
            return {"kind": "file", "sha256": self.file.sha256}
        return {"kind": BPE, "vocab_size": self.vocab_size, "sample_bytes": self.sample_bytes,
                "recipe": BPE_TRAINING}


@dataclass(frozen=True)
class TokenizerFile:
    json: str
    sha256: str


END_OF_TEXT = "<|endoftext|>"
"""GPT-2's end-of-text token; a BPE trained here or read from a tokenizer.json may have it too."""


class UnknownCharacters(ValueError):
    """Characters a character vocabulary lacks (its model never saw them)."""

    def __init__(self, characters: list[str]):
        super().__init__(", ".join(map(repr, characters)))
        self.characters = characters


@dataclass(frozen=True)
class Vocabulary(Sequence):
    """The tokens a model knows, in id order (a sequence of them), and how text becomes them:
    characters when tokenizer is empty, else the byte-level BPE of that tokenizer.json."""

    tokens: list[str]
    tokenizer: str = ""
    bpe: Optional[Tokenizer] = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, vocab) -> "Vocabulary":
        """A Vocabulary as it is, or one of characters from their list."""
        return vocab if isinstance(vocab, Vocabulary) else cls(list(vocab))

    @classmethod
    def from_json(cls, tokenizer_json: str) -> "Vocabulary":
        bpe = Tokenizer.from_str(tokenizer_json)
        return cls(token_list(bpe), tokenizer_json, bpe)

    @classmethod
    def made_by(cls, choice: TokenizerChoice) -> "Vocabulary":
        """The vocabulary a tokenizer choice names by itself: a tokenizer.json's (read once, for path
        and val_path alike: GPT-2's takes a third of a second) or a set's characters."""
        return _of_json(choice.file.json) if choice.file is not None else cls(list(choice.characters))

    @classmethod
    def kept(cls, tokens: list[str], tokenizer: str) -> "Vocabulary":
        """The Vocabulary of what a snapshot keeps: its tokens and a BPE's tokenizer.json ("": none)."""
        return cls.from_json(tokenizer) if tokenizer else cls(list(tokens))

    @property
    def is_char(self) -> bool:
        return not self.tokenizer

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i]

    def encode(self, text: str) -> list[int]:
        """The ids of text; UnknownCharacters naming, in order, those a character vocabulary lacks."""
        if not self.is_char:
            return self._bpe().encode(text, add_special_tokens=False).ids
        unknown = list(dict.fromkeys(ch for ch in text if ch not in self._ids))
        if unknown:
            raise UnknownCharacters(unknown)
        return [self._ids[ch] for ch in text]

    def token_id(self, token: str) -> Optional[int]:
        """The id of a whole token ("<|endoftext|>", "a"), or None when there is no such token."""
        return self._ids.get(token)

    @cached_property
    def _ids(self) -> dict[str, int]:
        return {token: i for i, token in enumerate(self.tokens)}

    def decode(self, ids: list[int]) -> str:
        if self.is_char:
            return "".join(self.tokens[i] for i in ids)
        return self._bpe().decode(ids, skip_special_tokens=False)

    def _bpe(self) -> Tokenizer:
        return self.bpe or Tokenizer.from_str(self.tokenizer)


@lru_cache(maxsize=1)
def _of_json(tokenizer_json: str) -> Vocabulary:
    return Vocabulary.from_json(tokenizer_json)


def token_list(tokenizer: Tokenizer) -> list[str]:
    """The tokens in id order ("" for an id the tokenizer leaves unused)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    return tokens


# -------------------------------------------------------------------------------- a tokenizer.json

def read_tokenizer_file(path: str, key: str = TOKENIZER_KEY) -> TokenizerFile:
    """The content of a tokenizer.json holding a byte-level BPE; DataError naming key if it is
    missing, unreadable, not a tokenizers file, or of another kind."""
    try:
        raw = files.read_bytes(path)
    except FileNotFoundError:
        raise DataError(f"{key}: no such file {path}; give char, bpe (trained on the text) or the "
                        "path of a byte-level BPE tokenizer.json") from None
    except Exception as e:
        raise DataError(f"{key}: cannot read {path} ({short_reason(e)}); check the path and its "
                        "permissions") from None
    text = raw.decode("utf-8", errors="replace")
    try:
        config = json.loads(text)
        tokenizer = Tokenizer.from_str(text)
    except Exception as e:
        raise DataError(f"{key}: {path} is not a tokenizers tokenizer.json ({short_reason(e)}); "
                        "give a tokenizer.json as tokenizers or transformers save it") from None
    problem = not_byte_level_bpe(config)
    if problem:
        raise DataError(f"{key}: {path} is {problem}, not a byte-level BPE; give a byte-level BPE "
                        "tokenizer.json (GPT-2's kind) or data_config.tokenizer=bpe")
    size = len(token_list(tokenizer))
    if size > MAX_VOCAB:
        raise DataError(f"{key}: {path} has {size:,} tokens, more than token files hold ({MAX_VOCAB:,})")
    return TokenizerFile(text, hashlib.sha256(raw).hexdigest())


def not_byte_level_bpe(config: dict) -> Optional[str]:
    """What a tokenizer.json is when it is not a byte-level BPE ("a WordPiece model"), else None."""
    model = (config.get("model") or {}).get("type", "unknown")
    if model != "BPE":
        return f"a {model} model"
    parts = [config.get("pre_tokenizer") or {}, config.get("decoder") or {}]
    parts += [p for part in list(parts) for p in part.get("pretokenizers", []) + part.get("decoders", [])]
    if not any(part.get("type") == "ByteLevel" for part in parts):
        return "a BPE without a ByteLevel pre-tokenizer or decoder (not over bytes)"
    return None


# ----------------------------------------------------------------------------------------- training

def train_bpe(texts: Iterator[str], vocab_size: int, special_tokens: Sequence[str] = ()) -> Tokenizer:
    """A byte-level BPE with GPT-2's pre-tokenizer, trained on texts. Training is deterministic
    (the same texts give the same merges in every process, whatever its thread count), so every
    machine of a job makes the same tokenizer from the same corpus. special_tokens (a set of
    documents' <|endoftext|>) take the first ids and count in vocab_size."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=MIN_FREQUENCY, show_progress=False,
                                  special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def sample_windows(size: int, sample_bytes: int, seed: int = 0) -> list[tuple[int, int]]:
    """(offset, length) of SAMPLE_WINDOWS windows of a text of size bytes, evenly spaced (each
    shifted at random within its share, seeded), together sample_bytes; the whole text if smaller."""
    if size <= sample_bytes:
        return [(0, size)]
    length = sample_bytes // SAMPLE_WINDOWS
    share = size // SAMPLE_WINDOWS
    rng = random.Random(seed)
    return [(i * share + rng.randrange(max(share - length, 1)), length) for i in range(SAMPLE_WINDOWS)]


def window_text(raw: bytes, whole: bool) -> str:
    """A window's text: whole words only (cut after its first and before its last whitespace,
    unless it is the whole text), characters cut at its ends dropped."""
    if not whole:
        first = next((i for i, b in enumerate(raw) if b in b" \n"), len(raw))
        last = max(raw.rfind(b" "), raw.rfind(b"\n"))
        raw = raw[first:last + 1] if last > first else b""
    return raw.decode("utf-8", errors="ignore")
