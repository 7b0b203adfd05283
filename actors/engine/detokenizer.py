"""Incremental detokenization and stop strings.

Text grows token by token with two offsets into the id list (vLLM's scheme): the text of
``ids[prefix_offset:read_offset]`` was already emitted, and a new token emits whatever the
decode of ``ids[prefix_offset:]`` adds to it, unless that ends in U+FFFD (a multi-byte
character split across tokens: wait for the rest). The decode window starts a few tokens
before the output so tokenizers that drop a leading space at the start of a decode
(SentencePiece) still give the right text.

For a byte-level BPE tokenizer (:class:`TokenPieces` says which) the common step needs no
decode call: when the window's text is complete UTF-8 and the new token's bytes are complete
characters on their own, the window's decode is its old text followed by the token's, so the
token's text (decoded once per tokenizer and id) is the step's. Every other step decodes as
above; both give the same text.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Sequence

logger = logging.getLogger(__name__)

_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class TokenPieces:
    """The text of each token of a byte-level BPE tokenizer that decodes to complete UTF-8
    characters (its *piece*; an empty string for the others: special and added tokens, byte
    fragments, ids outside the vocabulary), decoded once per id on first use.

    For such a tokenizer ``decode(ids)`` is the lossy UTF-8 decoding of the tokens' bytes
    concatenated, so a window of pieces decodes to the pieces joined: that is what
    :meth:`of` checks (the decoder's type, no clean-up of spaces, random windows decoded
    both ways) before it hands out a table; None for any other tokenizer.
    """

    __slots__ = ("_tokenizer", "_pieces", "_special")

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._pieces: list[str | None] = [None] * len(tokenizer)  # None: not decoded yet
        self._special = frozenset(getattr(tokenizer, "added_tokens_decoder", {}) or ()) | \
            frozenset(getattr(tokenizer, "all_special_ids", ()) or ())

    @classmethod
    def of(cls, tokenizer: Any) -> "TokenPieces | None":
        """The table of ``tokenizer``, or None when its decode is not the concatenation of
        its tokens' bytes."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        if type(decoder).__name__ != "ByteLevel" or not hasattr(tokenizer, "decode"):
            return None
        try:
            sample = "x . y , z ! w ? it 's , do n't : a  b\t\n  \n\n ( c ) [ d ]"
            if tokenizer.decode(tokenizer.encode(sample, add_special_tokens=False)) != sample:
                return None  # the decode cleans spaces up, or is not byte-level
            table = cls(tokenizer)
            rng = random.Random(0)
            size = len(tokenizer)
            for _ in range(64):  # windows of pieces decode to the pieces joined
                ids = [t for t in (rng.randrange(size) for _ in range(rng.randint(1, 8)))
                       if table.get(t)]
                if tokenizer.decode(ids) != "".join(table.get(t) for t in ids):
                    return None
        except Exception:  # noqa: BLE001 - a tokenizer this check cannot read: decode as usual
            logger.debug("token pieces not used for %s", type(tokenizer).__name__,
                         exc_info=True)
            return None
        return table

    def get(self, token_id: int) -> str:
        """The token's piece, or "" when its text is not one on its own."""
        pieces = self._pieces
        if not 0 <= token_id < len(pieces):
            return ""
        piece = pieces[token_id]
        if piece is None:
            piece = ""
            if token_id not in self._special:
                text = self._tokenizer.decode([token_id])
                if _INCOMPLETE not in text:
                    piece = text
            pieces[token_id] = piece
        return piece

    def all_pieces(self, ids: Sequence[int]) -> bool:
        """Whether every one of ``ids`` has a piece (a window of them decodes to complete
        characters, joined)."""
        return all(self.get(t) for t in ids)


class IncrementalDetokenizer:
    """The growing output text of one sequence.

    Args:
        tokenizer: a transformers tokenizer.
        prompt_token_ids: the prompt (its last few ids give the decode context).
        skip_special_tokens, spaces_between_special_tokens: decode options.
        pieces: the tokenizer's :class:`TokenPieces`, when it has them.
    """

    __slots__ = ("_tokenizer", "_ids", "_prefix_offset", "_read_offset", "_kwargs", "text",
                 "_pieces", "_joined")

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        pieces: TokenPieces | None = None,
    ):
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._kwargs = dict(skip_special_tokens=skip_special_tokens)
        if not spaces_between_special_tokens:
            self._kwargs["spaces_between_special_tokens"] = False
        self.text = ""
        self._pieces = pieces
        # whether the window's tokens (ids[prefix_offset:read_offset]) all have pieces
        self._joined = pieces is not None and pieces.all_pieces(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, **self._kwargs) if ids else ""

    def add(self, token_id: int) -> str:
        """Appends one id; returns the text it completes (possibly empty)."""
        ids = self._ids
        if self._joined and self._read_offset == len(ids):
            # the window decodes to its pieces joined and nothing waits after it: with a
            # piece of its own, the token's text is the step's (the decode's, without it)
            piece = self._pieces.get(token_id)
            if piece:
                ids.append(token_id)
                self._prefix_offset = self._read_offset
                self._read_offset = len(ids)
                self.text += piece
                return piece
        ids.append(token_id)
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_INCOMPLETE):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self.text += delta
        if self._pieces is not None:
            self._joined = self._pieces.all_pieces(ids[self._prefix_offset:self._read_offset])
        return delta

    def skip(self, token_id: int) -> None:
        """Appends an id whose text must not appear (a stop token not included in the text)."""
        self._ids.append(token_id)
        self._prefix_offset = self._read_offset = len(self._ids)
        self._joined = self._pieces is not None  # an empty window

    def flush(self) -> str:
        """At the end: emits what is still held back (an incomplete character)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self._joined = self._pieces is not None  # an empty window
        self.text += delta
        return delta


def find_stop_string(
    text: str, num_new_chars: int, stop: Sequence[str], include: bool
) -> tuple[str, int] | None:
    """The earliest stop string that ``text``'s last ``num_new_chars`` characters complete.

    Returns ``(stop_string, cut)`` where ``text[:cut]`` is the text to keep (the stop string
    excluded unless ``include``), or None.
    """
    best: tuple[str, int] | None = None
    best_at = len(text) + 1
    for s in stop:
        start = max(0, len(text) - num_new_chars - len(s) + 1)
        at = text.find(s, start)
        if at != -1 and at < best_at:
            best, best_at = (s, at + len(s) if include else at), at
    return best


def visible_text(text: str, stop: Sequence[str], finished: bool) -> str:
    """The text that may be shown while generating: the last ``max(len(stop)) - 1`` characters
    are held back, since they may turn out to start a stop string."""
    if finished or not stop:
        return text
    hold = max(len(s) for s in stop) - 1
    return text[:len(text) - hold] if hold else text
