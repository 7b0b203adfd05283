"""Host side of a finished step: record sampled tokens and logprobs, detokenize, check the
stop conditions of docs/sampler.md §4, and build ``GenerationOutput`` rows."""

from __future__ import annotations

from functools import cached_property
from typing import Any

import numpy as np

from actors.engine.detokenizer import IncrementalDetokenizer, TokenPieces, find_stop_string
from actors.engine.generation_output import GenerationOutput, TopLogprobs
from actors.engine.logprob_rows import LogprobRows
from actors.engine.sequence import PENDING, Request, SeqStatus, Sequence
from sampler.seeding import sample_seed


class OutputProcessor:
    """Applies sampled tokens to sequences and decides when they finish.

    Args:
        tokenizer: for detokenization.
        max_model_len: sequences stop ("length") at this many tokens.
        vocab_size: width of a ``logprobs=-1`` top list.
    """

    def __init__(self, tokenizer: Any, *, max_model_len: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.logprob_rows = LogprobRows()  # logprobs per step until a sequence finishes

    @cached_property
    def _pieces(self) -> TokenPieces | None:
        """The tokenizer's token pieces, looked for at the first sequence that asks for text."""
        return TokenPieces.of(self.tokenizer)

    def start(self, seq: Sequence) -> None:
        """Prepares a sequence's output state (first admission or a fork)."""
        params = seq.request.params
        if seq.detok is None and params.detokenize:
            seq.detok = IncrementalDetokenizer(
                self.tokenizer, seq.request.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                pieces=self._pieces)
        if params.logprobs is not None and seq.logprobs is None:
            seq.logprobs, seq.sampled_ranks, seq.logprob_runs = [], [], []
            if params.logprobs != 0:
                seq.top_rows, seq.top_blocks = [], []
        if seq.request.token_logprobs and seq.raw_logprobs is None:
            seq.raw_logprobs, seq.temperature_logprobs = [], []

    # ------------------------------------------------------------------ per token
    def apply_step(self, seqs: list[Sequence], pending_pos: list[int], tokens: list[int],
                   extra: list[list[float]] | None, values: np.ndarray | None,
                   ranks: np.ndarray | None, top_ids: np.ndarray | None,
                   top_values: np.ndarray | None) -> list[Sequence]:
        """Applies one step's read-back results to the sequences that sampled in it (row
        ``r`` of each list or array is ``seqs[r]``'s): the sampled token at its placeholder
        ``pending_pos[r]``, the raw and temperature logprobs (``extra``) and the logprobs
        where asked (``values``, ``ranks`` ``[S]``, ``top_ids``/``top_values`` ``[S, k]``,
        through :class:`LogprobRows`). Returns the sequences that finished with this token;
        a sequence finished before (or aborted) drops its token."""
        finished, max_len = SeqStatus.FINISHED, self.max_model_len
        append_token = self.append_token
        lp_seqs, lp_rows, done = [], [], []
        for row, seq in enumerate(seqs):
            if seq.status is finished:
                continue
            if seq.raw_logprobs is not None:
                self.record_token_logprobs(seq, *extra[row])
            if seq.logprobs is not None:
                lp_seqs.append(seq)
                lp_rows.append(row)
            token, pos = tokens[row], pending_pos[row]
            end = pos + 1
            grammar, detok, request = seq.grammar, seq.detok, seq.request
            if (end < seq.max_num_tokens and end < max_len
                    and token not in request.stop_token_ids
                    and (detok is None or not request.params.stop)
                    and (grammar is None or (grammar.error_at < 0 and grammar.stopped_at < 0
                                             and grammar.num_accepted >= end - seq.num_prompt))):
                # append_token's path for a token that cannot end the sequence (no stop
                # strings to look for in its text, not a stop token, not the last allowed
                # position; a grammar that accepted it already, without an error or an end),
                # inlined: this loop runs for every row of every step
                seq.token_ids[pos] = token
                seq.num_pending -= 1
                if detok is not None:
                    detok.add(token)
            elif append_token(seq, token, pos):
                done.append(seq)
        if lp_seqs:  # before any finished sequence's output is built
            self.logprob_rows.record(lp_seqs, lp_rows, values, ranks, top_ids, top_values)
        return done

    def _top_k(self, seq: Sequence) -> int:
        k = seq.request.params.logprobs
        return self.vocab_size if k == -1 else k

    @staticmethod
    def record_token_logprobs(seq: Sequence, raw: float, temperature: float) -> None:
        """Appends one step's raw and temperature logprobs of the sampled token."""
        seq.raw_logprobs.append(raw)
        seq.temperature_logprobs.append(temperature)

    def append_token(self, seq: Sequence, token_id: int, pos: int) -> bool:
        """Writes the sampled ``token_id`` at ``pos`` (its placeholder); returns whether the
        sequence finished with it (finish_reason / stop_reason set, later tokens dropped)."""
        assert seq.token_ids[pos] == PENDING
        seq.token_ids[pos] = token_id
        seq.num_pending -= 1
        request = seq.request
        params = request.params
        num_out = pos + 1 - seq.num_prompt
        detok = seq.detok
        grammar = seq.grammar
        if grammar is not None:
            grammar.catch_up(seq)  # (accepted already when the step's masks were filled)
            error = grammar.error_by(num_out)
            if error is not None:
                seq.error = error
                return self._finish(seq, pos, "error", None)
        stop_allowed = num_out >= params.min_tokens
        if stop_allowed and token_id in request.stop_token_ids:
            if detok is not None:
                if params.include_stop_str_in_output:
                    detok.add(token_id)
                else:
                    detok.skip(token_id)
            # vLLM's stop_reason: the stop id the request asked for; None for an EOS token
            reason = token_id if token_id in params.stop_token_ids else None
            return self._finish(seq, pos, "stop", reason)
        if detok is not None:
            new_text = detok.add(token_id)
            if params.stop and new_text and stop_allowed:
                hit = find_stop_string(detok.text, len(new_text), params.stop,
                                       params.include_stop_str_in_output)
                if hit is not None:
                    detok.text = detok.text[:hit[1]]
                    return self._finish(seq, pos, "stop", hit[0])
        if grammar is not None and grammar.ended_by(num_out):  # nothing may follow
            if detok is not None:
                detok.flush()
            return self._finish(seq, pos, "stop", None)
        if pos + 1 >= seq.max_num_tokens or pos + 1 >= self.max_model_len:  # max_tokens
            if detok is not None:
                detok.flush()
            return self._finish(seq, pos, "length", None)
        return False

    @staticmethod
    def _finish(seq: Sequence, pos: int, reason: str, stop_reason: str | int | None) -> bool:
        del seq.token_ids[pos + 1:]  # a token sampled after this one (in flight) is dropped
        seq.num_pending = 0
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        return True

    def abort(self, seq: Sequence) -> None:
        """Marks a sequence aborted, keeping the tokens known so far."""
        if PENDING in seq.token_ids:
            del seq.token_ids[seq.token_ids.index(PENDING):]
        seq.num_pending = 0
        self.logprob_rows.flush(seq)
        n_out = seq.num_output_tokens
        for name in ("logprobs", "sampled_ranks", "top_rows", "top_blocks", "raw_logprobs",
                     "temperature_logprobs"):
            values = getattr(seq, name)
            if values is not None:
                del values[n_out:]
        if seq.detok is not None:
            seq.detok.flush()
        seq.finish_reason, seq.stop_reason = "abort", None

    # ------------------------------------------------------------------ outputs
    def top_logprobs_of(self, seqs: list[Sequence]) -> dict[int, TopLogprobs]:
        """The top logprobs of finished sequences, keyed by ``id(seq)``. Sequences that
        sampled in exactly the same steps (a wave of rows finishing together) are gathered
        one step at a time for the whole group, not one step at a time per sequence."""
        groups: dict[tuple[int, int, int], list[Sequence]] = {}
        tops: dict[int, TopLogprobs] = {}
        for seq in seqs:
            self.logprob_rows.flush(seq)
            blocks = seq.top_blocks
            if seq.top_rows is None:
                continue
            if not blocks:  # no step sampled yet (aborted early)
                k = self._top_k(seq)
                tops[id(seq)] = TopLogprobs(np.zeros((0, k), np.int64),
                                            np.zeros((0, k), np.float32))
                continue
            # one block per step sampled, so equal first and last blocks and an equal count
            # mean the same steps (a preempted sequence misses steps: its count differs)
            groups.setdefault((id(blocks[0]), id(blocks[-1]), len(blocks)), []).append(seq)
        for members in groups.values():
            ks = [self._top_k(m) for m in members]
            k = max(ks)
            rows = np.array([m.top_rows for m in members], np.int64)  # [members, steps]
            blocks = members[0].top_blocks
            ids = np.stack([b[0][rows[:, t], :k] for t, b in enumerate(blocks)], axis=1)
            values = np.stack([b[1][rows[:, t], :k] for t, b in enumerate(blocks)], axis=1)
            for i, (m, km) in enumerate(zip(members, ks)):
                tops[id(m)] = TopLogprobs(ids[i, :, :km], values[i, :, :km])
        return tops

    def build(self, seq: Sequence, top: TopLogprobs | None = None) -> GenerationOutput:
        """The output row of a finished sequence (``top``: its top logprobs when gathered
        already, :meth:`top_logprobs_of`)."""
        self.logprob_rows.flush(seq)
        if top is None and seq.top_rows is not None:
            top = self.top_logprobs_of([seq])[id(seq)]
        request = seq.request
        return GenerationOutput(
            id=request.request_id,
            sample_index=seq.sample_index,
            output_text=seq.detok.text if seq.detok is not None else None,
            output_token_ids=seq.output_token_ids,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=seq.logprobs,
            top_logprobs=top,
            sampled_ranks=seq.sampled_ranks,
            prompt_logprobs=list(request.prompt_logprobs)
            if request.prompt_logprobs is not None else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            seed=sample_seed(request.seed, seq.sample_index),
            prompt_token_ids=list(request.prompt_token_ids)
            if request.prompt_logprobs is not None else None,
            prompt_top_logprobs=list(request.prompt_top_logprobs)
            if request.prompt_top_logprobs is not None else None,
            raw_logprobs=seq.raw_logprobs,
            temperature_logprobs=seq.temperature_logprobs,
            error=seq.error,
        )

    @staticmethod
    def error_outputs(request_id: Any, n: int, error: str, *, seed: int | None = None,
                      num_prompt_tokens: int = 0) -> list[GenerationOutput]:
        """One "error" row per sample of a request that could not run."""
        return [
            GenerationOutput(id=request_id, sample_index=j, finish_reason="error", error=error,
                             seed=None if seed is None else sample_seed(seed, j),
                             num_prompt_tokens=num_prompt_tokens)
            for j in range(max(1, n))
        ]

    @staticmethod
    def unforked_abort_outputs(request: Request) -> list[GenerationOutput]:
        """One "abort" row per sample of an aborted request that had not been forked yet."""
        return [GenerationOutput(id=request.request_id, sample_index=j, finish_reason="abort",
                                 output_text="" if request.params.detokenize else None,
                                 num_prompt_tokens=request.num_prompt_tokens,
                                 seed=sample_seed(request.seed, j))
                for j in range(len(request.sequences), request.params.n)]

    def record_prompt_logprobs(self, request: Request, positions: np.ndarray,
                               values: np.ndarray, top_ids: np.ndarray | None,
                               top_values: np.ndarray | None) -> None:
        """Stores scored prompt positions (``positions`` are the scored token indices)."""
        k = request.params.prompt_logprobs
        k = self.vocab_size if k == -1 else k
        for i, (p, v) in enumerate(zip(positions.tolist(), values.tolist())):
            request.prompt_logprobs[p] = v
            if request.prompt_top_logprobs is not None:
                request.prompt_top_logprobs[p] = _pairs(top_ids[i, :k], top_values[i, :k])


def _pairs(ids: np.ndarray, values: np.ndarray) -> list[dict[str, Any]]:
    return [{"token_id": i, "logprob": v} for i, v in zip(ids.tolist(), values.tolist())]
