"""Incremental detokenization and stop strings.

Text grows token by token with two offsets into the id list (vLLM's scheme): the text of
``ids[prefix_offset:read_offset]`` was already emitted, and a new token emits whatever the
decode of ``ids[prefix_offset:]`` adds to it, unless that ends in U+FFFD (a multi-byte
character split across tokens: wait for the rest). The decode window starts a few tokens
before the output so tokenizers that drop a leading space at the start of a decode
(SentencePiece) still give the right text.
"""

from __future__ import annotations

from typing import Any, Sequence

_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """The growing output text of one sequence.

    Args:
        tokenizer: a transformers tokenizer.
        prompt_token_ids: the prompt (its last few ids give the decode context).
        skip_special_tokens, spaces_between_special_tokens: decode options.
    """

    __slots__ = ("_tokenizer", "_ids", "_prefix_offset", "_read_offset", "_kwargs", "text")

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._kwargs = dict(skip_special_tokens=skip_special_tokens)
        if not spaces_between_special_tokens:
            self._kwargs["spaces_between_special_tokens"] = False
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, **self._kwargs) if ids else ""

    def add(self, token_id: int) -> str:
        """Appends one id; returns the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_INCOMPLETE):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def skip(self, token_id: int) -> None:
        """Appends an id whose text must not appear (a stop token not included in the text)."""
        self._ids.append(token_id)
        self._prefix_offset = self._read_offset = len(self._ids)

    def flush(self) -> str:
        """At the end: emits what is still held back (an incomplete character)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
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
