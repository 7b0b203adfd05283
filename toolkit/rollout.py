"""``toolkit.RolloutPool``: generation actors that stay up across RL rounds.

Each round: ``generate`` (prompts spread over the actors; n samples of a prompt share its KV)
returns an Arrow table with the job output columns and logprob columns of declared meaning
(``actors.rollout_table``); the trainer updates its weights; ``update_weights`` pushes them through
Ray's object store into every actor in place (nothing is reloaded from disk; the prefix cache
is reset); ``sleep`` / ``wake_up`` give the device memory to the trainer in between.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Sequence

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 30  # weights per object-store transfer
DEFAULT_COLUMNS = ("raw_logprobs", "temperature_logprobs")


class RolloutPool:
    """A pool of ``GenerationActor`` Ray actors, one model each, kept alive between rounds.

    Args:
        model: local directory or hub id (read once, when the actors start).
        num_actors: actors in the pool (replicas).
        engine: ``EngineConfig`` fields (dict) or an ``EngineConfig``.
        num_gpus_per_actor: GPUs per actor; 0 runs the engines on CPU. With
            ``engine={"tensor_parallel_size": tp}`` (tp > 1) an actor is a replica of ``tp``
            ranks, a Ray placement group of one bundle per rank (``STRICT_PACK``: one node),
            and this is GPUs per rank: a replica reserves ``tp * num_gpus_per_actor`` GPUs.
        num_cpus_per_actor: CPUs Ray reserves per actor (per rank with tp > 1).
        logprob_columns: default logprob columns of ``generate`` (see ``actors.rollout_table``).
        ray_address: Ray to connect to (None: the current one, ``RAY_ADDRESS``, else a local
            Ray on 127.0.0.1).

    Example:
        >>> pool = RolloutPool("Qwen/Qwen2.5-0.5B-Instruct", num_actors=2)  # doctest: +SKIP
        >>> table = pool.generate(["2+2="], {"n": 8, "temperature": 1.0, "max_tokens": 64})
        ... # doctest: +SKIP
        >>> pool.update_weights(trainer.state_dict())  # doctest: +SKIP
        >>> pool.shutdown()  # doctest: +SKIP
    """

    def __init__(self, model: str, num_actors: int = 1, *, engine: Any = None,
                 num_gpus_per_actor: float = 1, num_cpus_per_actor: float = 1,
                 logprob_columns: Sequence[str] = DEFAULT_COLUMNS,
                 ray_address: str | None = None):
        from actors.engine.engine_config import EngineConfig
        from actors.rollout_table import canonical_columns
        from jobs.cluster import check_resources, connect, replica_bundles

        self._actors: list[Any] = []
        self._groups: list[Any] = []  # the replicas' placement groups (tensor parallelism)
        if isinstance(num_actors, bool) or not isinstance(num_actors, int) or num_actors < 1:
            raise ValueError(f"num_actors: must be an integer >= 1, got {num_actors!r}")
        if num_gpus_per_actor < 0:
            raise ValueError(f"num_gpus_per_actor: must be >= 0, got {num_gpus_per_actor!r}")
        if num_cpus_per_actor < 0:
            raise ValueError(f"num_cpus_per_actor: must be >= 0, got {num_cpus_per_actor!r}")
        options = EngineConfig.coerce(engine).to_dict() if isinstance(engine, EngineConfig) \
            else dict(engine or {})
        if num_gpus_per_actor == 0:
            options.setdefault("device", "cpu")
        EngineConfig.check(options)  # fail here, naming the option; resolve on the actor
        # a replica: one actor, or with tensor parallelism a placement group of a bundle per rank
        bundles = replica_bundles(options, num_gpus_per_actor, num_cpus_per_actor)
        if bundles and not any(bundles[0].values()):
            raise ValueError("num_cpus_per_actor: must be > 0 when num_gpus_per_actor is 0 and "
                             "engine.tensor_parallel_size > 1 (each rank's bundle needs a "
                             "resource)")
        self.model = str(model)
        self.logprob_columns = canonical_columns(logprob_columns)
        connect(ray_address)
        ranks = len(bundles) if bundles else 1
        check_resources(num_actors, num_gpus_per_actor * ranks, num_cpus_per_actor * ranks)
        import ray

        try:
            self._start(num_actors, options, bundles, num_gpus_per_actor, num_cpus_per_actor)
            self._info = ray.get([a.info.remote() for a in self._actors])
            self._spec = ray.get(self._actors[0].weight_spec.remote())
        except BaseException:
            self.shutdown()
            raise
        logger.info("rollout pool: %d actor(s) of %s on %s", num_actors, self.model,
                    self._info[0]["device"])

    def _start(self, num_actors: int, options: dict[str, Any],
               bundles: list[dict[str, float]] | None, num_gpus: float,
               num_cpus: float) -> None:
        """Starts the actors, each in bundle 0 of a placement group of its own when
        ``bundles`` (its engine starts the other ranks in the other bundles)."""
        import ray

        from actors.actor import GenerationActor
        from jobs.cluster import in_bundle_zero, replica_group

        remote_cls = ray.remote(GenerationActor)
        for _ in range(num_actors):
            group = replica_group(bundles) if bundles else None
            if group is not None:
                self._groups.append(group)
            self._actors.append(remote_cls.options(
                num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_task_retries=0,
                scheduling_strategy=in_bundle_zero(group)).remote(self.model, options))

    # ------------------------------------------------------------------ generation
    @property
    def num_actors(self) -> int:
        return len(self._actors)

    def info(self) -> list[dict[str, Any]]:
        """Each actor's model and engine facts."""
        import ray

        return ray.get([a.info.remote() for a in self._live()])

    def generate(self, prompts: Any, params: Any = None, *, ids: Sequence[Any] | None = None,
                 logprob_columns: Sequence[str] | None = None) -> Any:
        """Generates for every prompt on the pool; returns a ``pyarrow.Table``.

        Args:
            prompts: strings, token-id lists or chat message lists.
            params: one ``SamplingParams`` / dict for all prompts, or one per prompt (each
                checked here: ``ValueError`` naming the prompt's position).
            ids: the ``id`` of each prompt (default: its position).
            logprob_columns: overrides the pool's default logprob columns for this call.

        Returns:
            One row per (prompt, sample), in prompt order then ``sample_index``: the job output
            columns (``actors.contract.schema``), then the logprob columns (``list<float32>``).
        """
        import pyarrow as pa
        import ray

        from actors.actor import params_per_prompt
        from actors.rollout_table import canonical_columns, prepare_params, rollout_schema
        from toolkit.generate import _normalise_prompts

        columns = self.logprob_columns if logprob_columns is None \
            else canonical_columns(logprob_columns)
        items = _normalise_prompts(prompts)
        per_prompt = params_per_prompt(params, len(items))
        prepared = prepare_params(per_prompt, columns)
        ids = list(range(len(items))) if ids is None else list(ids)
        if len(ids) != len(items):
            raise ValueError(f"ids: got {len(ids)} ids for {len(items)} prompts")
        id_type = pa.array(ids).type if ids else pa.int64()
        if pa.types.is_null(id_type):
            raise ValueError("ids: must not all be None")
        if not items:
            return rollout_schema(id_type, columns).empty_table()
        bounds = split_by_samples([p.n for p in prepared], self.num_actors)
        refs = [actor.generate_table.remote(items[a:b], prepared[a:b], ids[a:b],
                                            logprob_columns=columns, id_type=id_type)
                for actor, (a, b) in zip(self._live(), bounds) if b > a]
        return pa.concat_tables(ray.get(refs))

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, weights: Any, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
                       ) -> dict[str, Any]:
        """Loads new weights into every actor, in place; resets their prefix caches.

        Args:
            weights: a state dict (name -> tensor, Hugging Face names; a subset is fine), an
                iterable of ``(name, tensor)`` pairs (e.g. a sharded checkpoint read file by
                file, or a trainer gathering one tensor at a time), or a ``ray.ObjectRef`` to a
                state dict / ``WeightPayload`` (sent to every actor as is).
            chunk_bytes: tensors per object-store transfer; the next chunk is packed while
                the actors load the previous one.

        Returns:
            ``{"num_tensors", "num_bytes", "seconds"}`` of the whole update.

        Raises:
            ValueError / TypeError: naming the tensor (unknown name, shape, dtype), before
                anything is sent for a state dict; for an iterator, before its chunk is sent
                (earlier chunks stay loaded).
        """
        import ray

        t0 = time.perf_counter()
        actors = self._live()
        if isinstance(weights, ray.ObjectRef):
            stats = ray.get([a.update_weights.remote(weights) for a in actors])[0]
            return {**stats, "seconds": time.perf_counter() - t0}
        from actors.engine.weights import WeightPayload, iter_weights, pack_weights

        pairs = iter_weights(weights)
        if isinstance(weights, (Mapping, WeightPayload)):
            pairs = iter(list(self._checked(pairs)))  # all checked before the first send
        else:
            pairs = self._checked(pairs)
        pending: list[list[Any]] = []
        num = num_bytes = 0
        for chunk in chunked(pairs, chunk_bytes):
            payload = pack_weights(chunk)
            num, num_bytes = num + len(payload), num_bytes + payload.nbytes
            ref = ray.put(payload)
            pending.append([a.update_weights.remote(ref) for a in actors])
            del payload, ref
            if len(pending) > 1:  # one chunk loading while the next one is packed
                ray.get(pending.pop(0))
        for calls in pending:
            ray.get(calls)
        seconds = time.perf_counter() - t0
        logger.info("weights pushed to %d actor(s): %d tensors, %.1f MiB in %.2f s",
                    len(actors), num, num_bytes / 2**20, seconds)
        return {"num_tensors": num, "num_bytes": num_bytes, "seconds": seconds}

    def _checked(self, pairs: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        import torch

        from actors.engine.weights import check_tensor, unknown_names_error

        seen: set[str] = set()
        for name, value in pairs:
            if name not in self._spec:
                raise unknown_names_error([name], self._spec)
            if name in seen:
                raise ValueError(f"weights[{name!r}]: given twice in one update")
            seen.add(name)
            shape, dtype = self._spec[name]
            yield name, check_tensor(name, value, shape, getattr(torch, dtype))

    def sleep(self, level: int = 1) -> dict[str, int]:
        """Frees every actor's KV cache (level 1) and weights (level 2: reload them with
        ``update_weights`` after ``wake_up``); returns the bytes freed, summed."""
        import ray

        freed = ray.get([a.sleep.remote(level) for a in self._live()])
        return {key: sum(f[key] for f in freed) for key in freed[0]}

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocates what ``sleep`` freed (``tags`` ⊆ {"weights", "kv_cache"})."""
        import ray

        ray.get([a.wake_up.remote(tags) for a in self._live()])

    def reset_prefix_cache(self) -> None:
        """Forgets every actor's prefix cache (done by ``update_weights`` already)."""
        import ray

        ray.get([a.reset_prefix_cache.remote() for a in self._live()])

    # ------------------------------------------------------------------ lifetime
    def _live(self) -> list[Any]:
        if not self._actors:
            raise RuntimeError("the rollout pool was shut down")
        return self._actors

    def shutdown(self) -> None:
        """Stops the actors (their memory is freed) and removes the replicas' placement
        groups, which ends their other ranks; the pool cannot be used afterwards."""
        import ray

        from jobs.cluster import remove_replica_group, wait_until_dead

        actors, self._actors = self._actors, []
        groups, self._groups = self._groups, []
        for actor in actors:
            ray.kill(actor)
        for group in groups:
            remove_replica_group(group)
        wait_until_dead(actors)  # gone before the caller's Ray shuts down (see there)

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def split_by_samples(counts: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous ``[a, b)`` prompt ranges, one per part, with about equal sample counts."""
    total = sum(counts)
    bounds, start, acc = [], 0, 0
    for k in range(1, parts + 1):
        target = total * k / parts
        end = start
        while end < len(counts) and (acc + counts[end] / 2 <= target or k == parts):
            acc += counts[end]
            end += 1
        bounds.append((start, end))
        start = end
    return bounds


def chunked(pairs: Iterable[tuple[str, Any]], chunk_bytes: int
            ) -> Iterator[list[tuple[str, Any]]]:
    """Groups ``(name, tensor)`` pairs into lists of about ``chunk_bytes``."""
    chunk, size = [], 0
    for name, value in pairs:
        chunk.append((name, value))
        size += value.numel() * value.element_size()
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk
