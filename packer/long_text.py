"""Tokenizing a long text in bounded pieces, exactly, and only until it is over `maxLength`.

Tokenizing costs up to ~270 bytes of memory a character (a digit or a CJK character is one token,
and the tokenizer keeps offsets, strings and masks per token), so one 32 MB record of digits cost
9.5 GiB tokenized whole. A text of at most `WHOLE_CHARS` characters is still tokenized whole; a
longer one is tokenized `PIECE_CHARS` at a time, cut between pre-tokens, and the walk stops once the
ids are more than `limit`: the rest of the text can only add to them, and what was taken is exactly
the start of the whole text's ids (`PieceEncoder` says why), so truncation stays exact.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable
from typing import Any

from packtrain.core.contract import MAX_UNSPLIT_CHARS, RejectReason
from packtrain.packer.sources.conversation import SampleError

WHOLE_CHARS = 1 << 18
"""Texts up to this many characters are tokenized in one call (at most ~70 MB of tokenizer state)."""
PIECE_CHARS = 1 << 16
"""Characters tokenized at a time in a longer text."""
MIN_MARGIN = 64
"""Characters at the end of a piece whose pre-tokens are left to the next piece (at least; more when
the tokenizer has longer added tokens)."""


class PieceEncoder:
    """The ids of a text, tokenized in bounded pieces, as one call on the whole text gives them.

    Why the pieces add up to the whole. A Hugging Face tokenizer splits the text at its added tokens,
    normalizes the rest (Qwen's: NFC), pre-tokenizes it (Qwen's: one regex, then bytes to symbols)
    and runs BPE on each pre-token alone: no token crosses a pre-token boundary, so the ids of a text
    are the ids of its pre-tokens in order. A piece starting at a pre-token boundary of the whole
    text is pre-tokenized as the whole text is from there on, except where a decision looks past the
    piece's end: Qwen's regex looks at most two characters past a pre-token to end it, and an added
    token is matched over at most its own length. So every pre-token of the piece that ends more
    than `margin` (at least 64, and past the longest added token) characters before the piece's end is
    a pre-token of the whole text; the piece is cut at the start of the first one that does not, its
    ids before the cut are kept, and the next piece starts at the cut, a boundary again.
    Normalization: a cut is taken only where the normalizer splits too: the character after it is a
    starter (Unicode combining class 0; nothing is reordered across it) that does not compose with
    the one before it (checked with the tokenizer's own normalizer), and a starter composes only
    with the character right before it. Induction over the cuts: the kept ids are a prefix of the
    whole text's ids, and with the last piece (tokenized whole) they are all of them.

    A pre-token (letters, spaces or symbols with no break) that fills a piece cannot be cut: the
    piece doubles, up to `MAX_UNSPLIT_CHARS` (more is an `unsplittable_text` reject).
    Tokenizers whose normalizer or pre-tokenizer are not local in this way (`local`) are not cut:
    a text over `WHOLE_CHARS` is then `unsplittable_text`.
    """

    def __init__(
        self,
        backend: Any,
        encode: Callable[[str], list[int]],
        run_ids: tuple[int, int],
        *,
        whole_chars: int = WHOLE_CHARS,
        piece_chars: int = PIECE_CHARS,
    ) -> None:
        """`encode`: one call on a whole text; `run_ids`: the vision start and end tokens (a prefix
        never ends inside a vision run, so its media are whole)."""
        self._backend = backend
        self._encode = encode
        self._start, self._end = run_ids
        self.whole_chars = whole_chars
        self.piece_chars = piece_chars
        added = backend.get_added_tokens_decoder().values()
        self.margin = max(MIN_MARGIN, max((len(t.content) for t in added), default=0) + 8)
        self.local = local_tokenizer(backend)
        normalizer = backend.normalizer
        self._normalize: Callable[[str], str] = normalizer.normalize_str if normalizer else str

    def __call__(self, text: str, limit: int) -> tuple[list[int], bool]:
        """(ids, complete): all the ids of `text`, or (complete False) exactly their first ones, more
        than `limit` of them, never ending inside a vision run."""
        if len(text) <= self.whole_chars:
            return self._encode(text), True
        if not self.local:
            raise SampleError(
                RejectReason.UNSPLITTABLE_TEXT,
                f"text of {len(text)} characters: this tokenizer cannot be run on it piece by piece, and "
                f"more than {self.whole_chars} are not tokenized at once",
            )
        ids: list[int] = []
        pos, size, open_runs = 0, self.piece_chars, 0
        largest = MAX_UNSPLIT_CHARS + self.margin
        while len(text) - pos > size:
            cut, kept = self._cut(text[pos : pos + size])
            if cut == 0:  # one pre-token runs through the piece's kept part
                if size >= largest:
                    raise SampleError(
                        RejectReason.UNSPLITTABLE_TEXT,
                        f"text of {len(text)} characters: from character {pos} on, a run of over "
                        f"{MAX_UNSPLIT_CHARS} characters the tokenizer cannot split; not tokenized",
                    )
                size = min(2 * size, largest)
                continue
            ids += kept
            pos, size = pos + cut, self.piece_chars
            open_runs += kept.count(self._start) - kept.count(self._end)
            if len(ids) > limit and open_runs <= 0:
                return ids, False
        ids += self._encode(text[pos:])
        return ids, True

    def _cut(self, piece: str) -> tuple[int, list[int]]:
        """Where to cut `piece` (0: nowhere) and the ids before the cut: at the start of the last
        pre-token that starts at most `margin` characters before the end, if that start is a cut
        the normalizer allows, else of an earlier one."""
        enc = self._backend.encode(piece, add_special_tokens=False)
        at = len(piece) - self.margin
        word = None
        while word is None and at > 0:
            word = enc.char_to_word(at)
            at -= 1
        for w in range(word or 0, 0, -1):
            chars, tokens = enc.word_to_chars(w), enc.word_to_tokens(w)
            if chars is not None and tokens is not None and chars[0] > 0 and self._splits(piece, chars[0]):
                ids: list[int] = enc.ids[: tokens[0]]
                return chars[0], ids
        return 0, []

    def _splits(self, text: str, at: int) -> bool:
        """Whether the normalizer treats `text[:at]` and `text[at:]` apart."""
        before, after = text[at - 1], text[at]
        if before < "\x80" and after < "\x80":
            return True
        if unicodedata.combining(after):
            return False
        return self._normalize(before + after) == self._normalize(before) + self._normalize(after)


_LOCAL_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
# The pre-tokenizer regexes whose look-ahead `PieceEncoder` bounds: `Qwen2Tokenizer`'s and
# `Qwen3_5Tokenizer`'s (letters take combining marks along).
_SPLITS = tuple(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?"
    + letters
    + r"+|\p{N}| ?[^\s"
    + others
    + r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    for letters, others in ((r"\p{L}", r"\p{L}"), (r"[\p{L}\p{M}]", r"\p{L}\p{M}"))
)


def _pre_tokenizer(split: str) -> dict[str, Any]:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }


def local_tokenizer(backend: Any) -> bool:
    """Whether `backend` is of the kind `PieceEncoder` cuts exactly: normalizers that act per
    character or combining sequence, a Qwen pre-tokenizer (the families' tokenizer classes build it
    whatever the model folder says), no token added per call, added tokens that take no whitespace
    around them."""
    normalizer = backend.normalizer
    if normalizer is not None:
        state = json.loads(normalizer.__getstate__())
        parts = state.get("normalizers", [state]) if state.get("type") == "Sequence" else [state]
        if any(part.get("type") not in _LOCAL_NORMALIZERS for part in parts):
            return False
    pre = backend.pre_tokenizer
    if pre is None or json.loads(pre.__getstate__()) not in [_pre_tokenizer(r) for r in _SPLITS]:
        return False
    post = backend.post_processor
    if post is not None and post.num_special_tokens_to_add(False):
        return False  # a BOS or EOS per call would be one per piece
    added = backend.get_added_tokens_decoder().values()
    return not any(t.lstrip or t.rstrip for t in added)
