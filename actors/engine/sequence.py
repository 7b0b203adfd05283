"""Host-side state of requests and of their sequences (one sequence per sample)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from sampler.params import SamplingParams

#: Placeholder for a token sampled on the device whose value the host has not read yet.
PENDING = -1


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One admitted request: prompt, params and the state its samples share."""

    request_id: Any
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()    # params.stop_token_ids ∪ EOS (unless ignored)
    # prompt logprobs, filled in position order by the rows the model scores
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[dict[str, Any]] | None] | None = None
    num_prompt_rows_scored: int = 0   # rows 0..k-1 scored (row p scores prompt token p+1)
    num_unfinished: int = 0           # samples not yet finished
    sequences: list[Sequence] = field(default_factory=list)
    # RL: also record raw and temperature logprobs of each sampled token (actors/rollout)
    token_logprobs: bool = False
    # structured outputs: the future of the compiled constraint (actors.engine.structured), or None
    grammar: Any = None
    # the prompt as an int64 array (made with the request, off the stepping thread when the
    # request is built ahead): what each sample's admission to the sampler hands over
    prompt_array: Any = None
    # the sampler's rows of its parameters (sampler.slot_params.SlotParams, made with the request
    # too): what each sample's admission writes into its slot
    sampler_rows: Any = None

    @property
    def is_compiling(self) -> bool:
        """Whether the request's constraint is still compiling (it waits to be admitted)."""
        return self.grammar is not None and not self.grammar.done()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt_scoring_done(self) -> bool:
        return (self.params.prompt_logprobs is None
                or self.num_prompt_rows_scored >= self.num_prompt_tokens - 1)


_seq_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample of a request: its tokens, KV pages, sampler slot and outputs so far."""

    request: Request
    sample_index: int
    token_ids: list[int]
    fanout: int = 1                 # samples this sequence forks into at its first sample
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[Any] = field(default_factory=list)  # keys of the known full blocks
    num_registered_blocks: int = 0  # leading blocks offered to the prefix cache
    slot: int = -1
    reserved_slots: list[int] = field(default_factory=list)  # slots kept for the forks
    pending_row: int = -1           # row of the in-flight step that samples token_ids[-1]
    num_pending: int = 0            # PENDING placeholders in token_ids
    steady_until: int = 0           # token count up to which decodes skip the scheduler's checks
    # outputs
    logprobs: list[float] | None = None
    sampled_ranks: list[int] | None = None
    # per step: this sequence's row in the step's top-k block, and the block (ids and values
    # [n, kout], shared by the sequences of one step: no copy per sequence)
    top_rows: list[int] | None = None
    top_blocks: list[tuple[Any, Any]] | None = None
    # steps recorded but not yet in the lists above (actors.engine.logprob_rows)
    logprob_runs: list[tuple[Any, int, int]] | None = None
    raw_logprobs: list[float] | None = None          # when request.token_logprobs
    temperature_logprobs: list[float] | None = None
    detok: Any = None
    grammar: Any = None             # its own actors.engine.structured_sequence.SequenceGrammar
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    # fixed at creation, read on the per-step path: prompt length, and the token count at
    # which max_tokens is reached
    num_prompt: int = field(init=False)
    max_num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt = len(self.request.prompt_token_ids)
        max_tokens = self.request.params.max_tokens
        self.max_num_tokens = self.num_prompt + max_tokens if max_tokens is not None else 1 << 62

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.request.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def fork(self, sample_index: int) -> Sequence:
        """A sibling at the same point (tokens, computed count); pages are set by the caller."""
        child = Sequence(
            request=self.request,
            sample_index=sample_index,
            token_ids=list(self.token_ids),
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            block_hashes=list(self.block_hashes),
            num_registered_blocks=self.num_registered_blocks,
        )
        self.request.sequences.append(child)
        return child
