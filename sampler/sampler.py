"""The stateful ``Sampler`` the engine drives: per-slot state, one ``sample()`` per step."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from dataclasses import replace

from sampler.backends import pipeline_fn, resolve_backend
from sampler.grammar_mask import StepBitmask, check_bitmask
from sampler.ops.gumbel import NoisePrecision
from sampler.sampler_output import SamplerOutput
from sampler.params import SamplingParams
from sampler.step_plan import PlanCache
from sampler.slot_params import SlotParams
from sampler.state import SamplerState, to_device
from sampler.validation import (
    as_bad_words,
    as_seed,
    as_token_array,
    as_token_arrays,
    check_logits,
)


def _as_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
    return value


class Sampler:
    """Logits -> token ids + logprobs for a persistent batch of ``max_num_seqs`` slots.

    Args:
        max_num_seqs: number of slots (the engine's largest batch).
        vocab_size: logit width, vocab padding excluded.
        device: device of the logits and of the per-slot state.
        eos_token_ids: the model's EOS ids (masked until ``min_tokens``, even under
            ``ignore_eos``).
        max_logprobs: the largest ``logprobs`` / ``prompt_logprobs`` a request may ask for.
        backend: "auto" | "torch" | "triton" | "flashinfer", chosen once here.
        noise_precision: "fp32" (default) or "fp64" Gumbel noise.

    Example:
        >>> s = Sampler(4, 10, device="cpu", eos_token_ids=[0])
        >>> s.add_request(2, SamplingParams(temperature=0.0), [1, 2], seed=7)
        >>> s.sample(torch.arange(10.0)[None, :], [2]).token_ids
        tensor([9])
    """

    def __init__(
        self,
        max_num_seqs: int,
        vocab_size: int,
        *,
        device: torch.device | str,
        eos_token_ids: Sequence[int],
        max_logprobs: int = 20,
        backend: str = "auto",
        noise_precision: NoisePrecision = "fp32",
    ) -> None:
        self.max_num_seqs = _as_positive_int("max_num_seqs", max_num_seqs)
        self.vocab_size = _as_positive_int("vocab_size", vocab_size)
        if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < 0:
            raise ValueError(f"max_logprobs: must be an int >= 0, got {max_logprobs!r}")
        if noise_precision not in ("fp32", "fp64"):
            raise ValueError(f"noise_precision: must be 'fp32' or 'fp64', got {noise_precision!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_logprobs = max_logprobs
        self.noise_precision: NoisePrecision = noise_precision
        eos = as_token_array("eos_token_ids", list(eos_token_ids), vocab_size).tolist()
        self.eos_token_ids = list(dict.fromkeys(eos))
        self.backend = resolve_backend(backend, self.device)
        self._run = pipeline_fn(self.backend, self.device)
        self.state = SamplerState(self.max_num_seqs, self.vocab_size, self.device,
                                  self.eos_token_ids)
        self._plans = PlanCache()

    # ------------------------------------------------------------------ requests
    def _check_slot(self, slot: object) -> int:
        if type(slot).__module__ == "numpy" and hasattr(slot, "item"):
            slot = slot.item()
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_num_seqs:
            raise ValueError(f"slot: must be an int in [0, {self.max_num_seqs}), got {slot!r}")
        return slot

    def add_request(
        self,
        slot: int,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        *,
        seed: int,
        sample_index: int = 0,
        output_token_ids: Sequence[int] = (),
        bad_words_token_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        """Puts a request (one sample of it) into ``slot``, replacing what was there.

        Args:
            slot: the slot, in ``[0, max_num_seqs)``.
            params: the request's validated SamplingParams (checked against the vocab here).
            prompt_token_ids: the prompt ids (repetition penalty's prompt set).
            seed: the resolved seed, in ``[0, 2**63)`` (never None: resolve unseeded
                requests with :func:`~sampler.seeding.derive_seed` first).
            sample_index: which of the request's n samples this slot draws.
            output_token_ids: tokens already generated (re-admission after preemption): the
                output position and the counts continue from them; -1 marks a token not known
                yet (counted in the position, never in the counts).
            bad_words_token_ids: the request's bad words, tokenized (each word as given and
                with a leading space), as lists of ids.

        Raises:
            ValueError: naming the argument, for an invalid slot, seed, id or parameter.
        """
        self.add_requests([slot], [self.prepare(params, bad_words_token_ids)],
                          [prompt_token_ids], seeds=[seed], sample_indices=[sample_index],
                          output_token_ids=[output_token_ids])

    def prepare(self, params: SamplingParams,
                bad_words_token_ids: Sequence[Sequence[int]] = ()) -> SlotParams:
        """A request's parameters checked against the model and turned into its rows of the
        slot tables, once, for :meth:`add_requests` (any thread: it reads no slot).

        Raises:
            ValueError: naming the argument, for an invalid parameter or bad word.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: must be a SamplingParams, got {type(params).__name__}")
        params.verify_for_model(self.vocab_size, max_logprobs=self.max_logprobs)
        return self.state.prepare(params, as_bad_words(bad_words_token_ids, self.vocab_size))

    def add_requests(
        self,
        slots: Sequence[int],
        rows: Sequence[SlotParams],
        prompt_token_ids: Sequence[Sequence[int]],
        *,
        seeds: Sequence[int],
        sample_indices: Sequence[int],
        output_token_ids: Sequence[Sequence[int]],
    ) -> None:
        """Puts several requests into their slots at once, as :meth:`add_request` does one
        (the arguments are its, a list entry per slot; ``rows`` from :meth:`prepare`). Nothing
        is written unless every entry is valid.

        Raises:
            ValueError: naming the argument, for an invalid or repeated slot, seed or id.
        """
        count = len(slots)
        if not (len(rows) == len(prompt_token_ids) == len(seeds) == len(sample_indices)
                == len(output_token_ids) == count):
            raise ValueError("add_requests: every argument needs one entry per slot")
        slots = [self._check_slot(slot) for slot in slots]
        if len(set(slots)) != count:
            raise ValueError(f"slot: each slot at most once, got {slots}")
        for row in rows:
            if not isinstance(row, SlotParams):
                raise ValueError(f"rows: must come from Sampler.prepare, got {type(row).__name__}")
        seeds = [as_seed(seed) for seed in seeds]
        for sample_index in sample_indices:
            if isinstance(sample_index, bool) or not isinstance(sample_index, int) \
                    or sample_index < 0:
                raise ValueError(f"sample_index: must be an int >= 0, got {sample_index!r}")
        vocab = self.vocab_size
        prompts = as_token_arrays("prompt_token_ids", prompt_token_ids, vocab)
        outputs = as_token_arrays("output_token_ids", output_token_ids, vocab,
                                  allow_placeholder=True)
        self.state.add_requests(slots, list(rows), prompts, outputs, seeds,
                                list(sample_indices))

    def remove_request(self, slot: int) -> None:
        """Frees ``slot`` (finished, aborted or preempted request)."""
        self.state.remove_request(self._check_slot(slot))

    def remove_requests(self, slots: Sequence[int]) -> None:
        """Frees several slots at once (a step's finished requests)."""
        self.state.remove_requests([self._check_slot(slot) for slot in slots])

    # ------------------------------------------------------------------ step
    def _index(self, slots: Sequence[int] | torch.Tensor, rows: int,
               device_slots: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, np.ndarray | None]:
        if isinstance(slots, torch.Tensor) and slots.device.type != "cpu":
            if device_slots is not None:
                raise ValueError("device_slots: give `slots` as host ids with it")
            if slots.dim() != 1 or slots.shape[0] != rows:
                raise ValueError(f"slots: expected shape [{rows}], got {tuple(slots.shape)}")
            return slots.to(self.device, torch.int64), None
        host = np.asarray(slots.numpy() if isinstance(slots, torch.Tensor) else slots)
        if host.size == 0:
            host = host.astype(np.int64)
        if host.ndim != 1 or host.shape[0] != rows or not np.issubdtype(host.dtype, np.integer):
            raise ValueError(f"slots: expected {rows} slot ids (one per logits row)")
        host = host.astype(np.int64)
        if host.size and (host.min() < 0 or host.max() >= self.max_num_seqs):
            raise ValueError(f"slots: slot ids must be in [0, {self.max_num_seqs})")
        if not self.state.active[host].all():
            raise ValueError(f"slots: slot {int(host[~self.state.active[host]][0])} has no request")
        if host.size > 1 and np.bincount(host, minlength=self.max_num_seqs).max() > 1:
            raise ValueError("slots: a slot appears twice in one batch")
        if device_slots is None:
            return to_device(host, self.device), host
        if (not isinstance(device_slots, torch.Tensor) or device_slots.shape != (rows,)
                or device_slots.dtype != torch.int64 or device_slots.device != self.device):
            raise ValueError(f"device_slots: expected an int64 tensor of shape [{rows}] on "
                             f"{self.device} (the same slots as `slots`)")
        return device_slots, host

    def sample(self, logits: torch.Tensor, slots: Sequence[int] | torch.Tensor, *,
               device_slots: torch.Tensor | None = None,
               token_bitmask: StepBitmask | None = None) -> SamplerOutput:
        """Samples one token per row and advances each row's slot.

        Args:
            logits: ``[rows, vocab_size]`` float32/bf16/fp16 on ``device`` (a vocab slice of a
                padded tensor is fine). Float32 logits are overwritten (they end as the
                processed logits); bf16/fp16 logits are left untouched, but for the tokens
                ``token_bitmask`` clears, which may become -inf.
            slots: the slot of each row: a list of ints, a CPU LongTensor, or a LongTensor on
                the device (then the host-side predicates consider every active slot).
            device_slots: optional int64 ``[rows]`` copy of host ``slots`` already on the
                device (an engine uploads it with its step inputs): the step then makes no
                host-to-device copy of its own. Its values are trusted to equal ``slots``.
            token_bitmask: the grammar masks of the step's constrained rows
                (:class:`~sampler.grammar_mask.StepBitmask`), or None: a masked token is
                -inf after the raw snapshot (raw logprobs modes see the model's logits,
                processed ones the masked logits).

        Returns:
            :class:`~sampler.sampler_output.SamplerOutput` on the device. The slots' output
            positions, output-token counts and recent tokens are updated from the sampled ids
            on the device; nothing here waits for the device.
        """
        logits = check_logits(logits, self.vocab_size)
        if logits.device != self.device:
            raise ValueError(f"logits: must be on {self.device}, got {logits.device}")
        idx, rows_host = self._index(slots, logits.shape[0], device_slots)
        self.state.flush()
        plan = self._plans.get(self.state, rows_host)
        if token_bitmask is not None:
            check_bitmask(token_bitmask, logits.shape[0], self.vocab_size)
            plan = replace(plan, do_grammar=True)
        self.state.token_bitmask = token_bitmask
        try:
            return self._sample(logits, idx, rows_host, plan)
        finally:
            self.state.token_bitmask = None

    def _sample(self, logits: torch.Tensor, idx: torch.Tensor, rows_host: np.ndarray | None,
                plan) -> SamplerOutput:
        if self.backend == "triton":  # recorded by the step's kernels (no torch ops)
            return self._run(logits, idx, self.state, plan, inplace=True,
                             precision=self.noise_precision, record_rows=(rows_host,))
        out = self._run(logits, idx, self.state, plan, inplace=True,
                        precision=self.noise_precision)
        self.state.record_sampled(idx, out.token_ids, rows_host)
        return out
