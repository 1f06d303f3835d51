"""The ids of a whole corpus under a byte-level BPE, at tens of MB/s on two cores.

tokenizers itself encodes about 1 MB/s per core here: its pre-tokenizer's regular expression and
the alignment it keeps for every byte cost more than the merges. But a byte-level BPE encodes each
pre-token (a "word": a run of letters with the space before it, a number, a line break, ...) on its
own, so a text's ids are its words' ids one after the other, and a corpus holds few distinct words.
So, for tokenizers that split words with GPT-2's pattern (GPT-2's own, and the ones
tokenizer.train_bpe makes):
- the words of a chunk are found with numpy over its UTF-8 bytes (word_bounds, GPT-2's pattern
  exactly: the tests hold it against tokenizers on text made to break it);
- each distinct word is encoded once, by tokenizers itself (so the tokenizer's merges and options
  decide its ids), and kept in a table keyed by a hash of its bytes (word_keys, WordTable);
- a chunk's ids are then gathered from the table, and chunks are encoded in two threads (numpy
  releases the GIL for its loops).
Other byte-level BPEs (another split pattern, a normalizer) are encoded by tokenizers whole, in
pieces cut at line breaks (slow, but theirs). A chunk holding an added token's text (GPT-2's
<|endoftext|>) goes the slow way too: tokenizers matches added tokens before it splits words.

GPT-2's pattern (`'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`),
read as where words start:
- a word starts where the kind of character changes: letters, numbers, whitespace, other;
- a whitespace run followed by a non-whitespace character gives up its last character: a space
  starts the next word (" king"), any other ("\\n") is a word of its own; a run at the text's end
  stays whole;
- an apostrophe that starts a word (after a letter, a number or a whitespace other than a space)
  followed by s, t, m, d, re, ve or ll is a word of its own ("'s").
"""
import threading
import unicodedata
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator, Optional

import numpy as np
from tokenizers import Tokenizer

UNKNOWN, LETTER, NUMBER, OTHER, WHITE, SPACE = 0, 2, 4, 6, 8, 9
"""Kinds of character. WHITE: whitespace other than " "; a kind >= WHITE is whitespace, and
kind >> 1 is the same for both. UNKNOWN: a code point Python's Unicode tables leave unassigned,
which tokenizers' newer ones may make a letter: a piece holding one is left to tokenizers."""
WHITE_SPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                         0x2028, 0x2029, 0x202F, 0x205F, 0x3000])
"""Unicode's White_Space property: the pattern's \\s (Python's str.isspace adds 0x1C-0x1F)."""
APOSTROPHE = 0x27
CONTRACTIONS = ("s", "t", "m", "d", "re", "ve", "ll")
GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
PIECE_BYTES = 1 << 20
"""Bytes encoded at a time: the arrays of a piece stay in the CPU's caches."""
THREADS = 2
"""Pieces encoded at once. tokenizers' own thread pool (encode_batch_fast, the BPE's training) does
not survive a fork, and tokenizers 0.23 copes: a DataLoader worker forked after a preparation
neither warns nor hangs (checked), so TOKENIZERS_PARALLELISM is left as the user set it."""
MAX_WORDS = 1 << 19
"""The most distinct words the table keeps; past them it starts over (its memory stays bounded,
some 70 MB, and the frequent words are back at once)."""
LINE_PIECE_BYTES = 1 << 16
"""Slow path: tokenizers encodes a batch of pieces of about this size in parallel."""
LONGEST_LINE = 16 << 20
"""Slow path: a text without line breaks is cut at a word boundary after this many bytes."""


def char_kind(cp: int) -> int:
    if cp == 0x20:
        return SPACE
    if cp in WHITE_SPACE:
        return WHITE
    category = unicodedata.category(chr(cp))
    if category == "Cn":
        return UNKNOWN
    return LETTER if category[0] == "L" else NUMBER if category[0] == "N" else OTHER


BYTE_KINDS = np.array([char_kind(b) if b < 0x80 else UNKNOWN for b in range(256)], np.uint8)
"""The kind of each ASCII byte; the bytes of multi-byte characters are filled in by kinds_of."""


class CharKinds:
    """The kind of every code point seen so far, filled in as new ones appear (unicodedata)."""

    def __init__(self):
        self.kinds = np.zeros(0x110000, np.uint8)
        self.known = np.zeros(0x110000, bool)
        self.lock = threading.Lock()

    def __call__(self, cps: np.ndarray) -> np.ndarray:
        new = cps[~self.known[cps]]
        if len(new):
            with self.lock:
                for cp in np.unique(new).tolist():
                    self.kinds[cp] = char_kind(cp)
                self.known[new] = True
        return self.kinds[cps]


CHAR_KINDS = CharKinds()


def lead_bytes(data: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Of the positions of non-ASCII bytes, the first bytes of their characters, and those
    characters' code points (the text is valid UTF-8: it was decoded before)."""
    leads = high[data[high] >= 0xC0]
    first = data[leads].astype(np.uint32)
    length = 2 + (first >= 0xE0) + (first >= 0xF0)
    cps = first & (0x7F >> length)
    for k in (1, 2, 3):
        more = k < length
        following = data[np.minimum(leads + k, len(data) - 1)].astype(np.uint32) & 0x3F
        cps = np.where(more, (cps << 6) | following, cps)
    return leads, cps


def kinds_of(data: np.ndarray) -> tuple[Optional[np.ndarray], np.ndarray]:
    """The kind of each byte (every byte of a character has the character's), or None if a
    character's is UNKNOWN; and the positions of the first bytes of multi-byte characters."""
    kinds = np.take(BYTE_KINDS, data)
    high = np.flatnonzero(data >= 0x80)
    if not len(high):
        return kinds, high
    leads, cps = lead_bytes(data, high)
    lead_kinds = CHAR_KINDS(cps)
    if not lead_kinds.all():
        return None, leads
    kinds[high] = lead_kinds[np.searchsorted(leads, high, side="right") - 1]
    return kinds, leads


def word_bounds(data: np.ndarray) -> Optional[np.ndarray]:
    """Where GPT-2's pattern starts each word of data (UTF-8 bytes), and len(data) last; None if
    data holds a character of UNKNOWN kind."""
    kinds, leads = kinds_of(data)
    if kinds is None:
        return None
    n = len(data)
    start = np.empty(n + 1, bool)
    start[0] = start[n] = True
    merged = kinds >> 1  # one kind for all whitespace
    np.not_equal(merged[1:], merged[:-1], out=start[1:n])
    white = kinds >= WHITE
    last = np.flatnonzero(white[:-1] > white[1:])  # the last byte of a run before a non-whitespace
    if len(leads):  # a multi-byte whitespace character: its first byte
        multi = data[last] >= 0x80
        last[multi] = leads[np.searchsorted(leads, last[multi], side="right") - 1]
    start[last] = True
    start[last[data[last] == 0x20] + 1] = False  # the space starts the next word
    apostrophes = np.flatnonzero(data[:-1] == APOSTROPHE)
    if len(apostrophes):
        split_contractions(data, kinds, apostrophes, start)
    return np.flatnonzero(start)


def split_contractions(data: np.ndarray, kinds: np.ndarray, apostrophes: np.ndarray,
                       start: np.ndarray) -> None:
    """Mark the contractions ('s, 're, ...) as words of their own."""
    before = kinds[apostrophes - 1]  # at position 0 this reads the last byte, and is overruled
    starts_word = (apostrophes == 0) | (before == LETTER) | (before == NUMBER) | (before == WHITE)
    at = apostrophes[starts_word]
    padded = np.concatenate([data, np.zeros(2, np.uint8)])
    length = np.zeros(len(at), np.int64)
    for suffix in CONTRACTIONS:  # the 1-letter ones first: no 2-letter one starts with s, t, m, d
        match = (length == 0) & (padded[at + 1] == ord(suffix[0]))
        if len(suffix) == 2:
            match &= padded[at + 2] == ord(suffix[1])
        length[match] = 1 + len(suffix)
    found = length > 0
    at, length = at[found], length[found]
    start[at + 1] = False
    start[at + length] = True


# ------------------------------------------------------------------------------------- the table

MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(29))
LENGTH_MASKS = np.array([(1 << 8 * n) - 1 for n in range(8)] + [(1 << 64) - 1], np.uint64)
"""The bytes of a word of n bytes (n < 8; all 8 beyond) among the 8 read from its start."""


def word_keys(data: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each word's key and check, from its bytes read 8 at a time (a view of data at every byte).
    The check: its first 8 bytes and its length, which tell apart any two words of up to 7 bytes
    (most words). The key: a 64-bit hash of the check and of each further 8 bytes in turn (xor,
    then a bijective mix), so a longer word is taken for another only if both have the same length
    and first 8 bytes and their hashes meet by chance."""
    n = len(data)
    padded = np.zeros(n + 8, np.uint8)
    padded[:n] = data
    eight = np.ndarray((n,), np.dtype("<u8"), buffer=padded.data, strides=(1,))  # 8 bytes from each byte
    firsts, lengths = bounds[:-1], np.diff(bounds).astype(np.uint64)
    checks = eight[firsts] & LENGTH_MASKS[np.minimum(lengths, 8)]
    checks += lengths << np.uint64(56)  # the top byte of a word of up to 7 bytes is free
    keys = mix(checks ^ lengths)
    longer, offset = np.flatnonzero(lengths > 8), 8
    while len(longer):  # a round per 8 bytes, over the words that long
        rest = lengths[longer] - np.uint64(offset)
        block = eight[firsts[longer] + offset] & LENGTH_MASKS[np.minimum(rest, 8)]
        keys[longer] = mix(keys[longer] ^ block)
        longer, offset = longer[rest > 8], offset + 8
    return keys, checks


def mix(x: np.ndarray) -> np.ndarray:
    """A bijection of 64-bit values whose top bits depend on all bits (multiply, xorshift,
    multiply): the table's slots are the keys' top bits."""
    x = x * MIX[1]
    x ^= x >> MIX[2]
    x *= MIX[0]
    return x


class WordTable:
    """Each distinct word's ids, found by its key (word_keys): an open-addressing table on the key's
    top bits (linear probing, at most a quarter full), the word's check confirming each hit.
    Lookups and insertions take the lock; the id arrays a lookup returns are replaced, never
    changed, by later insertions, so they can be read without it."""

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype, bits: int = 16):
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.lock = threading.Lock()
        self._allocate(bits)
        self._forget_words()

    def _forget_words(self) -> None:
        self.offsets = self.lengths = np.zeros(0, np.int64)
        self.ids = np.zeros(0, self.dtype)
        """Word w's ids (of the dtype the caller keeps): ids[offsets[w] : offsets[w] + lengths[w]]."""

    def _allocate(self, bits: int) -> None:
        self.bits = bits
        self.keys = np.zeros(1 << bits, np.uint64)
        self.checks = np.zeros(1 << bits, np.uint64)
        self.words = np.full(1 << bits, -1, np.int64)

    def lookup(self, text: bytes, bounds: np.ndarray, keys: np.ndarray, checks: np.ndarray
               ) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """(word numbers, offsets, lengths, ids): each word's number, and where the words' ids
        are (the new words added first); None if two different words share a key (a collision:
        the caller then lets tokenizers encode the piece)."""
        with self.lock:
            words, slots = self._find(keys)
            new = np.flatnonzero(words < 0)
            if len(new):
                self._add(text, bounds, keys, checks, new)
                words, slots = self._find(keys)
            if not np.array_equal(self.checks[slots], checks):
                return None
            return words, self.offsets, self.lengths, self.ids

    def _find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The word number of each key (-1 where absent), and the slot where each was found."""
        mask = (1 << self.bits) - 1
        slots = (keys >> np.uint64(64 - self.bits)).astype(np.intp)
        words = self.words[slots]
        hit = self.keys[slots] == keys  # an empty slot's key is 0: a key 0 there is found as -1, absent
        if hit.all():  # most keys sit in their first slot
            return words, slots
        found = np.where(hit, words, -1)
        todo = np.flatnonzero(~hit & (words >= 0))  # an occupied slot of another key: try the next
        slots[todo] = (slots[todo] + 1) & mask
        while len(todo):
            at = slots[todo]
            words = self.words[at]
            hit = (self.keys[at] == keys[todo]) & (words >= 0)
            found[todo[hit]] = words[hit]
            todo = todo[~hit & (words >= 0)]  # an occupied slot of another key: try the next
            slots[todo] = (slots[todo] + 1) & mask
        return found, slots

    def _add(self, text: bytes, bounds: np.ndarray, keys: np.ndarray, checks: np.ndarray,
             new: np.ndarray) -> None:
        """Encode the distinct new words (tokenizers, in parallel) and add them."""
        _, first = np.unique(keys[new], return_index=True)
        first = new[first]
        if len(self.lengths) + len(first) > MAX_WORDS:
            self._allocate(16)
            self._forget_words()
        spans = zip(bounds[first].tolist(), bounds[first + 1].tolist())
        words = [text[a:b].decode("utf-8") for a, b in spans]
        encoded = [e.ids for e in self.tokenizer.encode_batch_fast(words, add_special_tokens=False)]
        lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
        ids = np.fromiter((i for word_ids in encoded for i in word_ids), self.dtype, int(lengths.sum()))
        numbers = len(self.lengths) + np.arange(len(first))
        self.offsets = np.concatenate([self.offsets, len(self.ids) + np.cumsum(lengths) - lengths])
        self.lengths = np.concatenate([self.lengths, lengths])
        self.ids = np.concatenate([self.ids, ids])
        bits = self.bits
        while 4 * len(self.lengths) > 1 << bits:
            bits += 2
        if bits > self.bits:
            self._rehash(bits)
        self._insert(keys[first], checks[first], numbers)

    def _rehash(self, bits: int) -> None:
        occupied = self.words >= 0
        old = self.keys[occupied], self.checks[occupied], self.words[occupied]
        self._allocate(bits)
        self._insert(*old)

    def _insert(self, keys: np.ndarray, checks: np.ndarray, numbers: np.ndarray) -> None:
        """Place keys (distinct, not in the table) at their first free slot, a round per probe."""
        mask = (1 << self.bits) - 1
        slots = (keys >> np.uint64(64 - self.bits)).astype(np.intp)
        todo = np.arange(len(keys))
        while len(todo):
            at = slots[todo]
            free = self.words[at] < 0
            _, first = np.unique(at, return_index=True)  # of keys wanting one slot, the first wins
            wins = np.zeros(len(todo), bool)
            wins[first] = True
            placed = todo[free & wins]
            self.keys[slots[placed]], self.checks[slots[placed]] = keys[placed], checks[placed]
            self.words[slots[placed]] = numbers[placed]
            todo = todo[~(free & wins)]
            slots[todo] = np.where(self.words[slots[todo]] >= 0, (slots[todo] + 1) & mask, slots[todo])


def gather_ids(words: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The ids of the words one after the other."""
    counts = lengths[words]
    ends = np.cumsum(counts)
    index = np.repeat(offsets[words] - (ends - counts), counts)
    index += np.arange(int(ends[-1]) if len(ends) else 0)
    return ids[index]


# ---------------------------------------------------------------------------------------- encoders

def uses_gpt2_words(config: dict) -> bool:
    """Whether a tokenizer.json's words are GPT-2's: its ByteLevel pre-tokenizer with the regex and
    no prefix space, and no normalizer."""
    pre = config.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 1:
        pre = pre["pretokenizers"][0]
    return config.get("normalizer") is None and all(pre.get(k) == v for k, v in GPT2_PRE_TOKENIZER.items())


class Encoder:
    """The ids of pieces of a text under one tokenizer (encode_pieces), of dtype."""

    def __init__(self, tokenizer: Tokenizer, config: dict, dtype: np.dtype = np.dtype(np.int64)):
        self.tokenizer = tokenizer
        self.fast = uses_gpt2_words(config)
        self.table = WordTable(tokenizer, dtype)
        self.added = [token["content"].encode("utf-8") for token in config.get("added_tokens", [])]

    def encode(self, piece: bytes) -> np.ndarray:
        if self.fast and not any(token in piece for token in self.added):
            ids = self.encode_words(piece)
            if ids is not None:
                return ids
        return self.encode_lines(piece)

    def encode_words(self, piece: bytes) -> Optional[np.ndarray]:
        data = np.frombuffer(piece, np.uint8)
        bounds = word_bounds(data)
        if bounds is None:
            return None
        found = self.table.lookup(piece, bounds, *word_keys(data, bounds))
        return None if found is None else gather_ids(*found)

    def encode_lines(self, piece: bytes) -> np.ndarray:
        """tokenizers' own ids, a batch of pieces cut at line breaks at a time."""
        lines = list(cut_pieces([piece], LINE_PIECE_BYTES, line_cut))
        encoded = self.tokenizer.encode_batch_fast([line.decode("utf-8") for line in lines],
                                                   add_special_tokens=False)
        return np.fromiter((i for e in encoded for i in e.ids), self.table.dtype)


def encode_pieces(tokenizer: Tokenizer, config: dict, texts: Iterable[str],
                  dtype: np.dtype = np.dtype(np.int64), encoder: Optional[Encoder] = None
                  ) -> Iterator[np.ndarray]:
    """The ids (of dtype) of texts (a text in chunks cut anywhere), a piece at a time, in order:
    pieces cut where both sides encode as the whole would, encoded in THREADS threads. encoder: one
    made for this tokenizer and dtype before, whose table of words is then kept (the files of a set)."""
    encoder = encoder or Encoder(tokenizer, config, dtype)
    cut = word_cut if encoder.fast else line_cut
    pieces = cut_pieces((text.encode("utf-8") for text in texts), PIECE_BYTES, cut)
    with ThreadPoolExecutor(THREADS) as pool:
        pending: deque = deque()
        for piece in pieces:
            pending.append(pool.submit(encoder.encode, piece))
            if len(pending) > THREADS:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def cut_pieces(chunks: Iterable[bytes], size: int, cut) -> Iterator[bytes]:
    """The bytes of chunks again, in pieces of about size bytes or more, each ending where cut(data,
    start) says a piece may end, at or after start (None: nowhere)."""
    carry = b""
    for chunk in chunks:
        data, first = carry + chunk, 0
        while len(data) - first >= size and (at := cut(data, first + size)) is not None:
            yield data[first:at]
            first = at
        carry = data[first:]
    if carry:
        yield carry


def word_cut(data: bytes, start: int) -> Optional[int]:
    """Where GPT-2's words may be cut, at or after start: between two ASCII characters of different
    kinds, neither whitespace nor an apostrophe (a letter then a full stop, ...): a word ends there
    whatever the text around it."""
    for end in (start + (1 << 16), len(data)):  # near start first: the rest only if need be
        window = np.frombuffer(data, np.uint8)[start - 1:end]
        kinds = np.take(BYTE_KINDS, window)
        plain = (kinds >= LETTER) & (kinds <= OTHER) & (window != APOSTROPHE)
        at = np.flatnonzero(plain[:-1] & plain[1:] & (kinds[:-1] != kinds[1:]))
        if len(at):
            return start + int(at[0])
    return None


def line_cut(data: bytes, start: int) -> Optional[int]:
    """After a line break between two characters that are not whitespace, at or after start (split
    patterns keep line breaks apart from the words around them); in a line longer than
    LONGEST_LINE, where a word may end (word_cut)."""
    at = start - 1
    while (at := data.find(b"\n", at)) >= 0:
        if 0 < at < len(data) - 1 and not chr(data[at - 1]).isspace() and not chr(data[at + 1]).isspace():
            return at + 1
        at += 1
    return word_cut(data, start) if len(data) - start > LONGEST_LINE else None
