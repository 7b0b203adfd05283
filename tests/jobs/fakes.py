"""A fake engine and actor for driver tests: deterministic outputs, no model, fault hooks.

The fake honours the engine contract of docs/architecture.md: ``add_request`` never raises,
bad requests come back from ``step()`` as error outputs, one output per sample. Every active
request makes one token per step, so requests of different lengths finish at different steps
(continuous batching). Prompts drive fault injection:

- ``"DIE-ONCE:<path> ..."``: the process exits the first time (``<path>`` remembers it);
- ``"DIE-SHARED:<path> ..."``: as ``DIE-ONCE``, but first waits (up to 30 s) until another
  ``process_shard`` call runs on the actor too, so that the death takes two shards or more;
- ``"DIE-ALWAYS ..."``: the process exits every time;
- ``"RAISE ..."``: ``step()`` raises (a broken engine).

Only the first word is the instruction, so a fault prompt can keep the word count (the fake's
prompt token count) of the prompt it replaces.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Any

import ray.cloudpickle

from actors.engine.generation_output import GenerationOutput

ray.cloudpickle.register_pickle_by_value(__import__(__name__))

VOCAB = 97


def fake_token(seed: int, sample: int, position: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{sample}/{position}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % VOCAB


def _num_prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt.split())
    if prompt and isinstance(prompt[0], dict):
        return sum(len(str(m.get("content", "")).split()) for m in prompt)
    return len(prompt)


class FakeEngine:
    """``add_request`` / ``step`` / ``has_unfinished_requests`` with made-up tokens."""

    def __init__(self) -> None:
        self.active: dict[str, dict[str, Any]] = {}
        self.errors: list[GenerationOutput] = []
        self.requests_seen = 0
        self.cache_resets = 0
        self.shards_running = 0  # the actor's process_shard calls under way

    def add_requests(self, requests: Any, *, fresh_prefix_cache: bool = False) -> None:
        if fresh_prefix_cache:
            self.cache_resets += 1
        for request_id, prompt, params in requests:
            self.add_request(request_id, prompt, params)

    def add_request(self, request_id: str, prompt: Any, params: Any) -> None:
        self.requests_seen += 1
        word = prompt.split()[0] if isinstance(prompt, str) and prompt.strip() else ""
        if word.startswith(("DIE-ONCE:", "DIE-SHARED:")):
            marker = word.split(":", 1)[1]
            if not os.path.exists(marker):
                deadline = time.monotonic() + 30.0
                while (word.startswith("DIE-SHARED:") and self.shards_running < 2
                       and time.monotonic() < deadline):
                    time.sleep(0.01)
                open(marker, "w").close()
                os._exit(1)
        if word == "DIE-ALWAYS":
            os._exit(1)
        if prompt == "" or prompt == []:
            self.errors.extend(GenerationOutput(id=request_id, sample_index=j, seed=params.seed,
                                                finish_reason="error", error="prompt is empty")
                               for j in range(params.n))
            return
        self.active[request_id] = {"prompt": prompt, "params": params, "step": 0}

    def has_unfinished_requests(self) -> bool:
        return bool(self.active or self.errors)

    def step(self) -> list[GenerationOutput]:
        if any(str(r["prompt"]).startswith("RAISE") for r in self.active.values()):
            raise RuntimeError("fake engine broke")
        finished, self.errors = self.errors, []
        for rid, req in list(self.active.items()):
            req["step"] += 1
            params = req["params"]
            if req["step"] >= (params.max_tokens or 16):
                del self.active[rid]
                finished.extend(self._outputs(rid, req["prompt"], params))
        return finished

    def _outputs(self, rid: str, prompt: Any, params: Any) -> list[GenerationOutput]:
        outs = []
        num_prompt = _num_prompt_tokens(prompt)
        for j in range(params.n):
            ids = [fake_token(params.seed, j, i) for i in range(params.max_tokens or 16)]
            k = params.logprobs
            outs.append(GenerationOutput(
                id=rid, sample_index=j, output_text=" ".join(f"t{t}" for t in ids),
                output_token_ids=ids, finish_reason="length",
                logprobs=[-t / VOCAB for t in ids] if k is not None else None,
                top_logprobs=([[{"token_id": t, "logprob": -t / VOCAB}] * k for t in ids]
                              if k else None),
                sampled_ranks=[1] * len(ids) if k is not None else None,
                prompt_logprobs=([None] + [-0.5] * (num_prompt - 1)
                                 if params.prompt_logprobs is not None else None),
                num_prompt_tokens=num_prompt, num_output_tokens=len(ids), seed=params.seed))
        return outs


class FakeActor:
    """Stands in for ``GenerationActor`` (same constructor and ``process_shard``; the first
    shard is read ahead as there)."""

    def __init__(self, model: str, engine_config: Any = None, *, first_shard: Any = None) -> None:
        from actors.shard import ShardPrefetch

        self.model = model
        self.engine = FakeEngine()
        self._calls_lock = threading.Lock()
        self._prefetch = ShardPrefetch(first_shard) if first_shard is not None else None
        if self._prefetch is not None:
            self._prefetch.engine_ready(self.engine)

    def process_shard(self, task):
        from actors.serving import server_for
        from actors.shard import process_shard

        with self._calls_lock:  # Ray runs the calls on threads
            self.engine.shards_running += 1
        try:
            server = server_for(self, self.engine)
            prepared = self._prefetch.take(task) if self._prefetch is not None else None
            return process_shard(task, lambda requests, **built: server.run(
                requests, exclusive=task.deterministic, **built), prepared)
        finally:
            with self._calls_lock:
                self.engine.shards_running -= 1


class SlowFakeEngine(FakeEngine):
    """A FakeEngine whose steps take 20 ms, so a test can act in the middle of a job."""

    def step(self) -> list[GenerationOutput]:
        time.sleep(0.02)
        return super().step()


class SlowFakeActor(FakeActor):
    def __init__(self, model: str, engine_config: Any = None, *, first_shard: Any = None) -> None:
        super().__init__(model, engine_config, first_shard=first_shard)
        self.engine = SlowFakeEngine()


class BrokenActor(FakeActor):
    """An actor whose constructor fails (a model that cannot load on the workers)."""

    def __init__(self, model: str, engine_config: Any = None, *, first_shard: Any = None) -> None:
        raise RuntimeError("cannot load the model on this worker")


def dies_while_starting(token: str) -> type:
    """A FakeActor whose process exits inside its constructor if it is the first to claim the
    file ``token`` (one death while starting per job)."""

    class DiesWhileStartingActor(FakeActor):
        def __init__(self, model: str, engine_config: Any = None, *,
                     first_shard: Any = None) -> None:
            try:
                os.rename(token, f"{token}.claimed-by-{os.getpid()}")
            except FileNotFoundError:
                super().__init__(model, engine_config, first_shard=first_shard)
            else:
                os._exit(1)

    return DiesWhileStartingActor


def recording(directory: str) -> type:
    """A SlowFakeActor that records how full it got: the most requests its engine held at
    once and the most ``process_shard`` calls it ran at once, written to
    ``<directory>/<pid>.json`` as each call returns."""
    import json

    class RecordingEngine(SlowFakeEngine):
        peak_active = 0

        def step(self) -> list[GenerationOutput]:
            self.peak_active = max(self.peak_active, len(self.active))
            return super().step()

    class RecordingActor(SlowFakeActor):
        def __init__(self, model: str, engine_config: Any = None, *,
                     first_shard: Any = None) -> None:
            super().__init__(model, engine_config, first_shard=first_shard)
            self.engine = RecordingEngine()
            self._lock = threading.Lock()
            self._calls = self._peak_calls = 0

        def process_shard(self, task):
            with self._lock:
                self._calls += 1
                self._peak_calls = max(self._peak_calls, self._calls)
            try:
                return super().process_shard(task)
            finally:
                with self._lock:
                    self._calls -= 1
                    record = {"peak_active": self.engine.peak_active,
                              "peak_calls": self._peak_calls}
                    with open(os.path.join(directory, f"{os.getpid()}.json"), "w") as f:
                        json.dump(record, f)

    return RecordingActor
