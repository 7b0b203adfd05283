"""Launching one scheduled step on the device and reading it back one step later.

``StepExecutor.launch`` runs the model, the LM head on the rows that need it, the sampler,
and the prompt-logprob scoring, and starts the device-to-host copies (``AsyncOutput``); it
returns an ``InflightStep`` without waiting for the device. The sampled ids stay on the
device for the next launch to gather its decode inputs from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from actors.engine.model.model_runner import ModelRunner
from actors.engine.scheduler_output import SchedulerOutput
from actors.engine.sequence import PENDING, Request, Sequence
from actors.engine.structured import StructuredOutputs
from sampler import AsyncOutput, Sampler, SamplerOutput, compute_prompt_logprobs
from sampler.ops.token_logprobs import compute_token_logprobs


@dataclass(slots=True)
class PromptScores:
    """Prompt positions scored in a step, for one request (values copied asynchronously)."""

    request: Request
    positions: np.ndarray   # prompt token indices scored (each >= 1)
    output: AsyncOutput


@dataclass(slots=True)
class InflightStep:
    """A launched step whose results the host has not read yet."""

    sample_seqs: list[Sequence]
    pending_pos: list[int]                 # index of each row's placeholder in its token_ids
    output: AsyncOutput | None             # sampler results (None: no row sampled)
    token_ids: torch.Tensor | None         # [rows] sampled ids, on the device
    prompt_scores: list[PromptScores] = field(default_factory=list)
    num_tokens: int = 0
    # [rows, 2] float32 (raw, temperature) logprobs of the sampled tokens, when a row asked
    # (the pair rides in the token_ids slot of the async copy)
    token_logprobs: AsyncOutput | None = None


class StepExecutor:
    """Runs scheduled steps: model, LM head, sampler, prompt logprobs.

    Args:
        runner: the model runner.
        sampler: the stateful sampler (one slot per running sequence).
        prompt_logprobs_chunk: rows per LM-head chunk when scoring prompts.
        structured: the engine's structured outputs (grammar masks of constrained rows),
            or None.
    """

    def __init__(self, runner: ModelRunner, sampler: Sampler, prompt_logprobs_chunk: int,
                 structured: StructuredOutputs | None = None):
        self.runner = runner
        self.sampler = sampler
        self.chunk = prompt_logprobs_chunk
        self.structured = structured

    def launch(self, sched: SchedulerOutput, prev: InflightStep | None) -> InflightStep:
        """Launches ``sched``; decode inputs still PENDING come from ``prev``'s sampled ids.
        The phases are methods so that a benchmark's ``StepTimer`` can time each of them
        (``actors.engine.step_timer``) without a check on this path."""
        step, inputs, logits = self.launch_model(sched, prev)
        if logits is not None:
            self.sample(sched, inputs, logits, step, prev)
        return step

    @torch.no_grad()
    def launch_model(self, sched: SchedulerOutput, prev: InflightStep | None
                     ) -> tuple[InflightStep, Any, torch.Tensor | None]:
        """The first part of :meth:`launch`: the inputs, the forward and the LM head; returns
        the step, its inputs and its logits (None when no row samples) for :meth:`sample`."""
        inputs = self.runner.prepare(sched, prev.sample_seqs if prev is not None else None)
        step, hidden = self.forward(sched, inputs, prev)
        return step, inputs, self.logits(hidden) if sched.sample_seqs else None

    def forward(self, sched: SchedulerOutput, inputs, prev: InflightStep | None
                ) -> tuple[InflightStep, torch.Tensor]:
        """The model forward of a prepared step, and the prompt rows it scores."""
        hidden = self.runner.execute(inputs, prev.token_ids if prev is not None else None)
        step = InflightStep([], [], None, None, num_tokens=sched.num_tokens)
        step.prompt_scores = self._score_prompts(sched, inputs.query_start_loc, hidden)
        return step, hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on the rows that sample (a forked sample reads its parent's row)."""
        runner = self.runner
        logits = runner.compute_logits(hidden[runner.sample_rows])
        if runner.sample_inverse is not None:
            logits = logits[runner.sample_inverse]
        return logits

    @torch.no_grad()
    def sample(self, sched: SchedulerOutput, inputs, logits: torch.Tensor,
               step: InflightStep, prev: InflightStep | None = None) -> None:
        """Samples every row, starts the copies back, marks each row's token PENDING."""
        sample_seqs = sched.sample_seqs
        wants_extra = any([seq.request.token_logprobs for seq in sample_seqs])
        mask = None
        structured = self.structured
        if structured is not None and structured.num_active:
            # the forward is queued: this step's masks, filled ahead (StructuredOutputs.
            # advance) or now for rows new to them
            mask = structured.step_mask(sample_seqs, lambda: prev.output.get().token_ids)
        # the sampler may overwrite float32 logits (the torch pipeline, also as the Triton
        # backend's fallback) and the masked tokens of any logits: keep the raw ones for the
        # extra logprobs
        raw = logits.clone() if wants_extra and (logits.dtype == torch.float32
                                                 or mask is not None) else logits
        out = self.sampler.sample(logits, inputs.sample_slots,
                                  device_slots=self.runner.sample_slots, token_bitmask=mask)
        if wants_extra:
            step.token_logprobs = self._token_logprobs(raw, out.token_ids, sample_seqs)
        step.output = AsyncOutput(out)
        step.token_ids = out.token_ids
        pending_pos = step.pending_pos
        for row, seq in enumerate(sample_seqs):
            tokens = seq.token_ids
            pending_pos.append(len(tokens))
            tokens.append(PENDING)
            seq.num_pending += 1
            seq.pending_row = row
        step.sample_seqs = sample_seqs  # the scheduler's list: the runner knows it by identity
        if mask is not None:  # the next step's masks are filled while this one runs
            structured.advance(sample_seqs, pending_pos, step.output)

    def _token_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor,
                        seqs: list[Sequence]) -> AsyncOutput:
        """Raw and temperature logprobs of every row's sampled token (T = 1 when greedy)."""
        temps = np.fromiter((seq.request.params.temperature or 1.0 for seq in seqs),
                            np.float32, len(seqs))
        raw, temp = compute_token_logprobs(logits, token_ids, self.runner.to_device(temps),
                                           backend=self.sampler.backend)
        return AsyncOutput(SamplerOutput(token_ids=torch.stack([raw, temp], dim=1)))

    def _score_prompts(self, sched: SchedulerOutput, query_start_loc: np.ndarray,
                       hidden: torch.Tensor) -> list[PromptScores]:
        """Prompt logprobs of the rows this step computed that score a prompt token."""
        scores = []
        for i in sched.prompt_chunks:  # chunks of a decode never score a prompt token
            request = sched.seqs[i].request
            params = request.params
            if params.prompt_logprobs is None or request.prompt_scoring_done:
                continue
            start = sched.starts[i]
            first = max(start, request.num_prompt_rows_scored)
            end = min(start + sched.num_new[i], request.num_prompt_tokens - 1)
            if end <= first:
                continue
            request.num_prompt_rows_scored = end
            row0 = int(query_start_loc[i]) + first - start
            # targets go to the device first: no host-side check, no synchronising copy
            targets = self.runner.to_device(
                np.asarray(request.prompt_token_ids[first + 1:end + 1], np.int64))
            parts = []
            for s in range(0, end - first, self.chunk):
                rows = hidden[row0 + s:row0 + min(s + self.chunk, end - first)]
                parts.append(compute_prompt_logprobs(
                    self.runner.compute_logits(rows), targets[s:s + self.chunk],
                    params.prompt_logprobs, mode=params.logprobs_mode,
                    temperature=params.temperature))
            out = parts[0] if len(parts) == 1 else _concat(parts)
            positions = np.arange(first + 1, end + 1, dtype=np.int64)
            scores.append(PromptScores(request, positions, AsyncOutput(out)))
        return scores


def _concat(parts: list) -> object:
    from sampler import SamplerOutput

    fields = ("token_ids", "logprobs", "ranks", "topk_ids", "topk_values")
    return SamplerOutput(*(
        None if getattr(parts[0], f) is None else torch.cat([getattr(p, f) for p in parts])
        for f in fields))
