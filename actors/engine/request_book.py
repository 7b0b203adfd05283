"""The engine's live requests: taken from the intake queue, added to the scheduler, failed,
aborted and finished, with the outputs that wait for the next ``Engine.step()``.

``RequestBook`` is driven by the stepping thread alone (``Engine.step`` holds its lock); the
intake queue it reads is the thread-safe side (:mod:`actors.engine.intake`).
"""

from __future__ import annotations

import itertools
from typing import Any

from actors.engine.generation_output import GenerationOutput
from actors.engine.intake import RequestIntake
from actors.engine.sequence import Request, Sequence

INTAKE_CHUNK = 64  # requests built between two checks of the scheduler's admission room


class RequestBook:
    """Requests from their intake to their last output.

    Attributes:
        requests: the unfinished requests by id.
        compiling: requests whose constraint is still compiling (in the scheduler, not
            admissible yet).
        ready: outputs for the next ``step()`` to return.
    """

    def __init__(self, intake: RequestIntake, scheduler: Any, sampler: Any, outputs: Any,
                 structured: Any, inputs: Any) -> None:
        self.intake = intake
        self.scheduler = scheduler
        self.sampler = sampler
        self.outputs = outputs
        self.structured = structured
        self.inputs = inputs
        self.requests: dict[Any, Request] = {}
        self.compiling: list[Request] = []
        self.ready: list[GenerationOutput] = []
        self._arrivals = itertools.count()

    def take_ready(self) -> list[GenerationOutput]:
        """The outputs gathered since the last call."""
        ready, self.ready = self.ready, []
        return ready

    def take_intake(self) -> None:
        """Adds queued requests, built in order, until the waiting queue can fill the next
        step's admissions (``Scheduler.admission_room``); the rest stay queued. Called before
        a step's schedule and after its launch, so a batch handed in at once is built while
        the device runs, a step's worth at a time, not all of it before the first launch."""
        if not self.intake.pending():
            return
        slots, tokens = self.scheduler.admission_room()
        while True:  # with no room left, only what precedes a queued abort
            items = self.intake.take(limit=INTAKE_CHUNK if slots > 0 and tokens > 0 else 0)
            if not items:
                return
            for item in items:
                kind = item[0]
                if kind == "built":
                    request = item[2]
                    self.add(request)
                    slots -= request.params.n
                    tokens -= request.num_prompt_tokens
                elif kind == "reject":
                    self.reject(*item[1:])
                else:
                    self.abort(item[1])

    def add(self, request: Request) -> None:
        """Puts a built request in the scheduler's waiting queue (its constraint, if any,
        compiling off this thread), or rejects it when its id is running."""
        request_id = request.request_id
        if request_id in self.requests:
            self.reject(request_id, request.params,
                        f"request id {request_id!r} is already running")
            return
        request.arrival = next(self._arrivals)
        seq = Sequence(request, 0, list(request.prompt_token_ids), fanout=request.params.n)
        request.sequences.append(seq)
        self.requests[request_id] = request
        constraint = request.params.structured_outputs
        if constraint is not None:  # compiled off this thread; admitted once it is done
            request.grammar = self.structured.submit(constraint)
            if request.params.min_tokens:  # the grammar alone decides where the text may end
                request.params = request.params.replace(min_tokens=0)
                request.sampler_rows = self.sampler.prepare(request.params,
                                                            request.bad_words_token_ids)
            self.compiling.append(request)
        self.scheduler.add(seq)

    def check_compiled(self) -> None:
        """Requests whose constraint failed to compile end as errors (before any device
        work); the others become admissible."""
        still = []
        for request in self.compiling:
            if not request.grammar.done():
                still.append(request)
                continue
            error = request.grammar.result().error
            if error is None or self.requests.get(request.request_id) is not request:
                continue
            for seq in request.sequences:
                self.scheduler.finish(seq)
            self.requests.pop(request.request_id, None)
            self.ready += self.outputs.error_outputs(
                request.request_id, request.params.n, error, seed=request.seed,
                num_prompt_tokens=request.num_prompt_tokens)
        self.compiling = still

    def reject(self, request_id: Any, params: Any, reason: str) -> None:
        """Error outputs for a request that cannot run (n and seed as far as its params can
        be read: they are parsed only here, off the path of good requests)."""
        n, seed = self.inputs.describe(request_id, params)
        self.ready += self.outputs.error_outputs(request_id, n, reason, seed=seed)

    def abort(self, request_id: Any) -> None:
        """Ends an unfinished request's samples with finish_reason "abort" (an unknown or
        finished id is ignored)."""
        request = self.requests.get(request_id)
        if request is None:
            return
        seqs = [seq for seq in request.sequences if not seq.is_finished]
        for seq in seqs:
            self.outputs.abort(seq)
        self.release(seqs)  # one write a sampler table for all of them
        self.ready += self.finish_all(seqs, {})
        self.ready += self.outputs.unforked_abort_outputs(request)
        self.requests.pop(request_id, None)

    def finish_all(self, seqs: list[Sequence], tops: dict) -> list[GenerationOutput]:
        """The outputs of finished sequences (``tops``: their top logprobs by ``id(seq)``),
        their matchers released; their pages and slots are freed by :meth:`release`."""
        structured, requests, build = self.structured, self.requests, self.outputs.build
        outputs = []
        for seq in seqs:
            structured.release(seq)
            request = seq.request
            request.num_unfinished -= 1
            if request.num_unfinished <= 0:
                requests.pop(request.request_id, None)
            outputs.append(build(seq, tops.get(id(seq))))
        return outputs

    def release(self, seqs: list[Sequence]) -> None:
        """Frees finished sequences' pages and sampler slots (one write a sampler table for
        them all)."""
        if seqs:
            self.sampler.remove_requests(self.scheduler.finish_all(seqs))
