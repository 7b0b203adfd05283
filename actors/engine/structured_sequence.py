"""What a constrained sequence holds: the compiled constraint it was copied from
(:class:`CompiledConstraint`, matcher templates) and its own matcher with the count of output
tokens it accepted and where its text ended or failed (:class:`SequenceGrammar`).
:class:`actors.engine.structured.StructuredOutputs` makes and steps them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actors.engine.sequence import PENDING, Sequence

ROWS_PER_TEMPLATE = 32  # sequences of one constraint per independent matcher template


@dataclass(slots=True)
class CompiledConstraint:
    """A compiled constraint: matcher templates to copy per sequence, or why it failed.

    Copies of one llguidance matcher share its lexer and its caches behind a lock, so many
    rows of one constraint filled in parallel wait on each other; a constraint with many
    live sequences gets one template per ``ROWS_PER_TEMPLATE`` of them, up to a limit (each
    compiled from ``grammar`` on first need, ~1 ms), and a new sequence copies the template
    with the fewest live ones."""

    template: Any = None  # llguidance.LLMatcher in its initial state
    error: str | None = None
    grammar: str = ""  # the llguidance grammar text it was compiled from
    templates: list = field(default_factory=list)  # the templates after ``template``
    live: list = field(default_factory=list)  # live sequences of each template
    initial_mask: Any = None  # the mask before any token (int32 words), once filled

    def first_mask(self, words: int) -> Any:
        """The mask of a sequence that has accepted no token: ``template``'s, filled on
        first need (every copy starts in its state). Only the stepping thread fills masks
        outside the ahead fill, whose rows have accepted tokens."""
        if self.initial_mask is None:
            import llguidance.torch
            import torch

            mask = torch.zeros(1, words, dtype=torch.int32)
            llguidance.torch.fill_next_token_bitmask(self.template, mask)
            self.initial_mask = mask[0]
        return self.initial_mask

    def next_copy(self, tokenizer: Any, max_templates: int) -> tuple[Any, int]:
        """A fresh matcher for one more sequence and the index of its template (give it
        back with :meth:`release` when the sequence ends)."""
        import llguidance

        wanted = min(max(1, max_templates), sum(self.live) // ROWS_PER_TEMPLATE + 1)
        if len(self.live) < wanted:
            self.live.extend([0] * (wanted - len(self.live)))
        index = min(range(wanted), key=self.live.__getitem__)
        self.live[index] += 1
        if index == 0:
            return self.template.deep_copy(), 0
        while len(self.templates) < index:
            self.templates.append(llguidance.LLMatcher(tokenizer, self.grammar, log_level=0))
        return self.templates[index - 1].deep_copy(), index

    def release(self, index: int) -> None:
        """One sequence of template ``index`` ended."""
        self.live[index] -= 1


class SequenceGrammar:
    """The matcher of one sequence, how many of its output tokens it accepted, and where its
    text ended or failed (output token counts, so that a reader behind the matcher sees the
    answer for the token it is at, whatever the matcher accepted since)."""

    __slots__ = ("matcher", "num_accepted", "error", "error_at", "stopped_at", "group",
                 "mask_turn", "mask_row", "mask_at")

    def __init__(self, matcher: Any, group: int = 0) -> None:
        self.matcher = matcher
        self.num_accepted = 0
        self.error: str | None = None
        self.error_at = -1  # the index of the refused output token
        self.stopped_at = -1  # output tokens after which the grammar ended (-1: not yet)
        self.group = group  # the template it was copied from (fills go in its order)
        self.mask_turn = -1  # the ahead fill that holds this sequence's next mask ...
        self.mask_row = -1  # ... in this row of its buffer,
        self.mask_at = -1  # filled after this many accepted tokens

    def new_tokens(self, seq: Sequence, pending: int = PENDING) -> list[int]:
        """The output tokens of ``seq`` not accepted yet, up to the first unknown one
        (``pending``: the value of a trailing placeholder, when the caller knows it)."""
        tokens = seq.token_ids
        start = seq.num_prompt + self.num_accepted
        if start == len(tokens) - 1 and tokens[start] == PENDING:
            return [] if pending == PENDING else [pending]  # a decode step's one token
        out = []
        for pos in range(start, len(tokens)):
            token = tokens[pos]
            if token == PENDING:
                if pos != len(tokens) - 1 or pending == PENDING:
                    break
                token = pending
            out.append(token)
        return out

    def accept(self, tokens: list[int]) -> None:
        """Advances the matcher over ``tokens`` (a refused token is the sequence's error)."""
        for token in tokens:
            self.accepted(self.error is not None or self.matcher.consume_token(token), token)

    def accepted(self, ok: bool, token: int) -> None:
        """Counts one token the matcher took (``ok``) or refused."""
        if not ok and self.error is None:
            self.error_at = self.num_accepted
            self.error = (f"structured_outputs: token {token} is not allowed by the grammar "
                          f"({self.matcher.get_error()[:200]})")
        self.num_accepted += 1
        if self.stopped_at < 0 and self.error is None and self.matcher.is_stopped():
            self.stopped_at = self.num_accepted

    @staticmethod
    def all_accepted(grammars: list[SequenceGrammar]) -> None:
        """:meth:`accepted` of a token each of ``grammars`` took (none of them with an error),
        in one loop (a parallel accept's rows)."""
        for grammar in grammars:
            grammar.num_accepted += 1
        SequenceGrammar.check_stopped(grammars)

    @staticmethod
    def check_stopped(grammars: list[SequenceGrammar]) -> None:
        """Notes where each of ``grammars`` ended, if its last accepted token ended it."""
        for grammar in grammars:
            if grammar.stopped_at < 0 and grammar.matcher.is_stopped():
                grammar.stopped_at = grammar.num_accepted

    def catch_up(self, seq: Sequence, pending: int = PENDING) -> None:
        """Accepts the output tokens of ``seq`` not accepted yet (see :meth:`new_tokens`)."""
        self.accept(self.new_tokens(seq, pending))

    def error_by(self, num_out: int) -> str | None:
        """The error of the first ``num_out`` output tokens, if one of them was refused."""
        return self.error if 0 <= self.error_at < num_out else None

    def ended_by(self, num_out: int) -> bool:
        """Whether the grammar reached an end where nothing but EOS may follow within the
        first ``num_out`` output tokens."""
        return 0 <= self.stopped_at <= num_out
