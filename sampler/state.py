"""Per-slot persistent sampler state (``max_num_seqs`` slots).

Small per-slot parameters live in host numpy mirrors written by :meth:`SamplerState.add_request`
and copied to the device once per step (:meth:`SamplerState.flush`, only when something
changed). Tables that the device updates itself — output position, output-token counts, the
prompt-token mask, the allowed-id mask, the recent output tokens for bad words — are written
from staged per-slot writes at the flush and from each step's sampled ids afterwards
(:meth:`SamplerState.record_sampled`), so a step needs nothing from the host. The large
``[max_num_seqs, vocab]`` tables are allocated the first time a request needs them.

``touch_bits`` marks, per slot, every token whose processed value (steps 2-6) may differ from
its raw logit: the prompt and output tokens of a request with penalties, its logit-bias ids,
its stop ids when it has ``min_tokens``, and the last token of each of its bad words. Tokens
without the bit keep their raw value, which lets the Triton candidate path
(:mod:`sampler.kernels.candidate_stats`) read the row once and process only the marked tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sampler.ops.bad_words import PAD_ANY
from sampler.params import SamplingParams
from sampler.slot_params import (
    FREQUENCY,
    HAS_ALLOWED,
    IS_GREEDY,
    NEUTRAL_F,
    NEUTRAL_I,
    PRESENCE,
    REPETITION,
    SAMPLE_INDEX,
    SEED,
    SlotParams,
    slot_params,
)


@dataclass(slots=True)
class _Staged:
    """Writes for one slot's device-updated tables, applied at the next flush."""

    prompt: np.ndarray
    output: np.ndarray
    allowed: np.ndarray | None
    penalties: bool
    specials: np.ndarray  # bias ids, stop ids (with min_tokens), bad words' last tokens


def _grow(array: np.ndarray, shape: tuple[int, ...], fill: float) -> np.ndarray:
    """A copy of ``array`` enlarged to ``shape``; new entries ``fill`` (right-aligned last dim
    for 2-d/3-d token tables is handled by the caller)."""
    out = np.full(shape, fill, dtype=array.dtype)
    out[tuple(slice(0, n) for n in array.shape)] = array
    return out


def _token_bits(staged: _Staged, num_words: int, specials: bool = False) -> np.ndarray:
    """One bit per token of a staged slot: its prompt and known output tokens when it has
    penalties (its penalty bits), and its special ids too with ``specials`` (its touch
    bits)."""
    parts = [staged.prompt, staged.output[staged.output >= 0]] if staged.penalties else []
    if specials:
        parts.append(staged.specials)
    bits = np.zeros(num_words, dtype=np.uint32)
    if parts:
        tokens = np.concatenate(parts).astype(np.int64)
        np.bitwise_or.at(bits, tokens >> 5, (np.uint32(1) << (tokens & 31).astype(np.uint32)))
    return bits.view(np.int32)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A device copy of a host array that never blocks the host on the device (pinned
    staging buffer + non-blocking copy on CUDA; a private copy on CPU)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.clone().to(device)


class SamplerState:
    """Persistent per-slot buffers of the sampler.

    Args:
        max_num_seqs: number of slots.
        vocab_size: vocabulary size (logit width).
        device: where the device buffers live.
        eos_token_ids: the model's EOS ids, masked until ``min_tokens`` like stop ids.
    """

    def __init__(
        self, max_num_seqs: int, vocab_size: int, device: torch.device, eos_token_ids: list[int]
    ) -> None:
        self.max_num_seqs, self.vocab_size, self.device = max_num_seqs, vocab_size, device
        self.eos_token_ids = list(eos_token_ids)
        s = max_num_seqs
        self.version = 0  # bumped by every add/remove: a step plan of an unchanged state
        # and batch holds (sampler.step_plan.PlanCache)
        self.active = np.zeros(s, dtype=bool)
        self.pos_host = np.zeros(s, dtype=np.int64)  # lower bound of the device position
        self.has_penalties = np.zeros(s, dtype=bool)
        self.has_bad_words = np.zeros(s, dtype=bool)
        self.has_bias = np.zeros(s, dtype=bool)
        self.has_seed = np.zeros(s, dtype=bool)  # the request set its own seed (params.seed)
        self.fparams_host = np.tile(np.array(NEUTRAL_F, dtype=np.float32), (s, 1))
        self.iparams_host = np.tile(np.array(NEUTRAL_I, dtype=np.int64), (s, 1))
        self.fparams = torch.from_numpy(self.fparams_host.copy()).to(device)
        self.iparams = torch.from_numpy(self.iparams_host.copy()).to(device)
        self.is_greedy = torch.zeros(s, dtype=torch.bool, device=device)
        self.has_allowed = torch.zeros(s, dtype=torch.bool, device=device)
        self.positions = torch.zeros(s, dtype=torch.int64, device=device)
        self._ones = torch.ones(s, dtype=torch.int64, device=device)  # increments of a step
        # host-mirrored small tables: stop ids, logit bias, bad words
        self.stop_ids_host = np.full((s, max(1, len(self.eos_token_ids))), -1, dtype=np.int64)
        self.bias_ids_host = np.zeros((s, 1), dtype=np.int64)
        self.bias_values_host = np.zeros((s, 1), dtype=np.float32)
        self.word_tokens_host = np.full((s, 1, 1), PAD_ANY, dtype=np.int64)
        self.word_lens_host = np.zeros((s, 1), dtype=np.int64)
        self.stop_ids = self.bias_ids = self.bias_values = None
        self.word_tokens = self.word_lens = None
        # device-updated tables, allocated on first need
        self.output_counts: torch.Tensor | None = None  # [S, V] int32
        # one bit per token: in the slot's prompt or output (kernels read the tables there)
        self.penalty_bits: torch.Tensor | None = None  # [S, ceil(V / 32)] int32
        self.prompt_mask: torch.Tensor | None = None  # [S, V] bool
        self.allowed_mask: torch.Tensor | None = None  # [S, V] bool
        # tokens whose processed value may differ from the raw one (module docstring)
        self.touch_bits: torch.Tensor | None = None  # [S, ceil(V / 32)] int32
        self.recent_tokens: torch.Tensor | None = None  # [S, window] int64
        # per row of a step, the chunk programs of a kernel that finished (the last one
        # finishes the row, then sets it back to 0): the Triton greedy step in one launch
        self.arrivals = torch.zeros(s, dtype=torch.int32, device=device)
        self._staged: dict[int, _Staged] = {}
        # the grammar masks of the step being sampled (a sampler.grammar_mask.StepBitmask),
        # set by Sampler.sample for that step only
        self.token_bitmask = None
        self._params_dirty = True
        self._tables_dirty = True

    # ------------------------------------------------------------------ host side
    def prepare(self, params: SamplingParams, bad_words: list[list[int]]) -> SlotParams:
        """A (validated) request's rows for :meth:`add_requests`."""
        return slot_params(params, self.eos_token_ids, bad_words)

    def add_request(
        self,
        slot: int,
        params: SamplingParams,
        prompt: np.ndarray,
        output: np.ndarray,
        seed: int,
        sample_index: int,
        bad_words: list[list[int]],
    ) -> None:
        """Writes a (validated) request into ``slot``; device tables follow at the flush."""
        self.add_requests([slot], [self.prepare(params, bad_words)], [prompt], [output],
                          [seed], [sample_index])

    def add_requests(self, slots: list[int], rows: list[SlotParams], prompts: list[np.ndarray],
                     outputs: list[np.ndarray], seeds: list[int],
                     sample_indices: list[int]) -> None:
        """Writes (validated) requests into their distinct ``slots``, one write a table for
        all of them; device tables follow at the flush."""
        if not slots:
            return
        self.version += 1
        index = np.asarray(slots, dtype=np.int64)
        irows = []
        for row, seed, sample_index in zip(rows, seeds, sample_indices):
            i = list(row.i)
            i[SEED], i[SAMPLE_INDEX] = seed, sample_index
            irows.append(i)
        self.fparams_host[index] = [row.f for row in rows]
        self.iparams_host[index] = irows
        self._params_dirty = True

        self.active[index] = True
        self.pos_host[index] = [len(output) for output in outputs]
        self.has_penalties[index] = [row.penalties for row in rows]
        self.has_seed[index] = [row.has_seed for row in rows]
        width = max(len(row.stops) for row in rows)
        if width > self.stop_ids_host.shape[1]:
            self.stop_ids_host = _grow(self.stop_ids_host, (self.max_num_seqs, width), -1)
        width = self.stop_ids_host.shape[1]
        self.stop_ids_host[index] = [(*row.stops, *(-1,) * (width - len(row.stops)))
                                     for row in rows]

        self.has_bias[index] = [bool(row.bias_ids) for row in rows]
        width = max(len(row.bias_ids) for row in rows)
        if width > self.bias_ids_host.shape[1]:
            shape = (self.max_num_seqs, width)
            self.bias_ids_host = _grow(self.bias_ids_host, shape, 0)
            self.bias_values_host = _grow(self.bias_values_host, shape, 0.0)
        self.bias_ids_host[index] = 0
        self.bias_values_host[index] = 0.0
        for slot, row in zip(slots, rows):
            if row.bias_ids:
                self.bias_ids_host[slot, :len(row.bias_ids)] = row.bias_ids
                self.bias_values_host[slot, :len(row.bias_ids)] = row.bias_values

        self.has_bad_words[index] = [bool(row.words) for row in rows]
        num_words = max(len(row.words) for row in rows)
        max_len = max((len(w) for row in rows for w in row.words), default=1)
        _, cur_words, cur_len = self.word_tokens_host.shape
        if num_words > cur_words or max_len > cur_len:
            new_words, new_len = max(num_words, cur_words), max(max_len, cur_len)
            grown = np.full((self.max_num_seqs, new_words, new_len), PAD_ANY, dtype=np.int64)
            grown[:, :cur_words, new_len - cur_len:] = self.word_tokens_host  # right-aligned
            self.word_tokens_host = grown
            self.word_lens_host = _grow(self.word_lens_host, (self.max_num_seqs, new_words), 0)
        self.word_tokens_host[index] = PAD_ANY
        self.word_lens_host[index] = 0
        width = self.word_tokens_host.shape[2]
        for slot, row in zip(slots, rows):
            for w, word in enumerate(row.words):
                self.word_tokens_host[slot, w, width - len(word):] = word
                self.word_lens_host[slot, w] = len(word)
        self._tables_dirty = True

        staged = self._staged
        for slot, row, prompt, output in zip(slots, rows, prompts, outputs):
            staged[slot] = _Staged(prompt, output, row.allowed, row.penalties, row.specials)

    def remove_request(self, slot: int) -> None:
        """Frees ``slot``: host flags and parameters return to neutral values."""
        self.remove_requests([slot])

    def remove_requests(self, slots: list[int]) -> None:
        """Frees ``slots``, one write a table for them all."""
        if not slots:
            return
        index = np.asarray(slots, dtype=np.int64)
        self.active[index] = False
        self.version += 1
        self.has_penalties[index] = self.has_bad_words[index] = self.has_bias[index] = False
        self.has_seed[index] = False
        self.fparams_host[index] = NEUTRAL_F
        self.iparams_host[index] = NEUTRAL_I
        self._params_dirty = True
        for slot in slots:
            self._staged.pop(slot, None)

    # ------------------------------------------------------------------ device side
    def _upload(self, dst: torch.Tensor | None, host: np.ndarray) -> torch.Tensor:
        """Copies ``host`` into ``dst`` (reallocated when its shape changed)."""
        if dst is None or tuple(dst.shape) != host.shape:
            dst = torch.empty(host.shape, dtype=torch.from_numpy(host[:0]).dtype,
                              device=self.device)
        src = torch.from_numpy(np.ascontiguousarray(host))
        if self.device.type == "cuda":
            dst.copy_(src.pin_memory(), non_blocking=True)
        else:
            dst.copy_(src)
        return dst

    def flush(self) -> None:
        """Brings the device buffers up to date with every add/remove since the last step.

        Host-to-device copies only (pinned, non-blocking on CUDA); never waits on the device.
        """
        if self._params_dirty:
            self.fparams = self._upload(self.fparams, self.fparams_host)
            self.iparams = self._upload(self.iparams, self.iparams_host)
            self.is_greedy = self.iparams[:, IS_GREEDY] != 0
            self.has_allowed = self.iparams[:, HAS_ALLOWED] != 0
            self._params_dirty = False
        if self._tables_dirty:
            self.stop_ids = self._upload(self.stop_ids, self.stop_ids_host)
            self.bias_ids = self._upload(self.bias_ids, self.bias_ids_host)
            self.bias_values = self._upload(self.bias_values, self.bias_values_host)
            self.word_tokens = self._upload(self.word_tokens, self.word_tokens_host)
            self.word_lens = self._upload(self.word_lens, self.word_lens_host)
            self._tables_dirty = False
        if self._staged:
            self._apply_staged()

    def _apply_staged(self) -> None:
        staged, self._staged = self._staged, {}
        slots = np.fromiter(staged.keys(), dtype=np.int64, count=len(staged))
        slots_d = to_device(slots, self.device)
        lengths = np.array([len(st.output) for st in staged.values()], dtype=np.int64)
        self.positions.index_copy_(0, slots_d, to_device(lengths, self.device))
        s, v = self.max_num_seqs, self.vocab_size

        if self.output_counts is None and any(st.penalties for st in staged.values()):
            self.output_counts = torch.zeros((s, v), dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros((s, v), dtype=torch.bool, device=self.device)
            self.penalty_bits = torch.zeros((s, (v + 31) // 32), dtype=torch.int32,
                                            device=self.device)
        if self.output_counts is not None:
            self.output_counts.index_fill_(0, slots_d, 0)
            self.prompt_mask.index_fill_(0, slots_d, False)
            out_rows, out_cols, pr_rows, pr_cols = [], [], [], []
            for slot, st in staged.items():
                if not st.penalties:
                    continue
                known = st.output[st.output >= 0]  # async placeholders (-1) are never counted
                out_rows.append(np.full(len(known), slot)), out_cols.append(known)
                pr_rows.append(np.full(len(st.prompt), slot)), pr_cols.append(st.prompt)
            if out_rows:
                rows, cols = (to_device(np.concatenate(a).astype(np.int64), self.device)
                              for a in (out_rows, out_cols))
                ones = torch.ones(rows.shape, dtype=torch.int32, device=self.device)
                self.output_counts.index_put_((rows, cols), ones, accumulate=True)
                rows, cols = (to_device(np.concatenate(a).astype(np.int64), self.device)
                              for a in (pr_rows, pr_cols))
                self.prompt_mask[rows, cols] = True
            self.penalty_bits.index_copy_(0, slots_d, to_device(
                np.stack([_token_bits(st, self.penalty_bits.shape[1]) for st in staged.values()]),
                self.device))
        if self.touch_bits is None and any(st.penalties or st.specials.size
                                           for st in staged.values()):
            self.touch_bits = torch.zeros((s, (v + 31) // 32), dtype=torch.int32,
                                          device=self.device)
        if self.touch_bits is not None:
            self.touch_bits.index_copy_(0, slots_d, to_device(
                np.stack([_token_bits(st, self.touch_bits.shape[1], specials=True)
                          for st in staged.values()]),
                self.device))

        with_allowed = {k: st.allowed for k, st in staged.items() if st.allowed is not None}
        if with_allowed:
            if self.allowed_mask is None:
                self.allowed_mask = torch.zeros((s, v), dtype=torch.bool, device=self.device)
            keys = np.fromiter(with_allowed.keys(), dtype=np.int64, count=len(with_allowed))
            self.allowed_mask.index_fill_(0, to_device(keys, self.device), False)
            rows = np.concatenate([np.full(len(a), k) for k, a in with_allowed.items()])
            cols = np.concatenate(list(with_allowed.values()))
            self.allowed_mask[to_device(rows.astype(np.int64), self.device),
                              to_device(cols, self.device)] = True

        window = max(1, self.word_tokens_host.shape[2] - 1)
        needs_window = bool(self.has_bad_words[slots].any())
        if needs_window or self.recent_tokens is not None:
            if self.recent_tokens is None or self.recent_tokens.shape[1] < window:
                grown = torch.full((s, window), -1, dtype=torch.int64, device=self.device)
                if self.recent_tokens is not None:
                    old = self.recent_tokens.shape[1]
                    grown[:, window - old:] = self.recent_tokens
                self.recent_tokens = grown
            width = self.recent_tokens.shape[1]
            recent = np.full((len(slots), width), -1, dtype=np.int64)
            for r, st in enumerate(staged.values()):
                tail = st.output[-width:]
                recent[r, width - len(tail):] = tail
            self.recent_tokens.index_copy_(0, slots_d, to_device(recent, self.device))

    def record_sampled(
        self, idx_mapping: torch.Tensor, token_ids: torch.Tensor, rows_host: np.ndarray | None
    ) -> None:
        """Advances the slots of a step from its sampled ids, on the device.

        Args:
            idx_mapping: ``[rows]`` int64 device tensor, the slot of each row (distinct).
            token_ids: ``[rows]`` int64 sampled ids.
            rows_host: the same slots as a host array when known (keeps ``pos_host`` exact).
        """
        ones = self._ones[:idx_mapping.shape[0]]  # distinct slots: at most max_num_seqs rows
        self.positions.index_add_(0, idx_mapping, ones)
        if self.output_counts is not None:
            self.output_counts.index_put_((idx_mapping, token_ids), ones.to(torch.int32),
                                          accumulate=True)
            words = token_ids >> 5  # slots are distinct, so (slot, word) pairs are too
            bit = (ones << (token_ids & 31)).to(torch.int32)
            self.penalty_bits.index_put_(
                (idx_mapping, words), self.penalty_bits[idx_mapping, words] | bit)
        if self.touch_bits is not None:  # a row with penalties: its new output token
            pen = ((self.fparams[idx_mapping, REPETITION] != 1.0)
                   | (self.fparams[idx_mapping, FREQUENCY] != 0.0)
                   | (self.fparams[idx_mapping, PRESENCE] != 0.0))
            words = token_ids >> 5
            bit = torch.where(pen, 1 << (token_ids & 31), 0).to(torch.int32)
            self.touch_bits.index_put_(
                (idx_mapping, words), self.touch_bits[idx_mapping, words] | bit)
        if self.recent_tokens is not None:
            shifted = torch.cat([self.recent_tokens[idx_mapping, 1:], token_ids[:, None]], dim=1)
            self.recent_tokens.index_copy_(0, idx_mapping, shifted)
        if rows_host is not None:
            self.pos_host[rows_host] += 1
