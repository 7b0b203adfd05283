"""``run_job``: check everything, plan, open the manifest, dispatch, finish.

Every job-level problem (config typo, unreadable input, missing column, unknown model,
unwritable output) is found here before Ray starts or any model loads, and raised as one
``ValueError`` naming it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from actors.contract.task import ShardResult
from jobs.config import ConfigLike, JobConfig, load_config
from jobs.manifest import Manifest
from jobs.plan import fill_rows, make_task, plan_document, plan_shards, underfilled_engine
from jobs.progress import JobResult, Progress, totals
from jobs.sources import discover
from jobs.storage import resolve

logger = logging.getLogger(__name__)


def engine_options(config: JobConfig) -> dict[str, Any]:
    """The job's ``engine`` mapping, checked against ``EngineConfig`` (ValueError naming an
    unknown or invalid key), with the job's ``trust_remote_code``, ``seed`` and, for CPU
    actors, ``device: cpu`` filled in. Shipped to the actors as a mapping: device and dtype
    defaults resolve where the engine runs, not on the driver."""
    from actors.engine.engine_config import EngineConfig

    values = dict(config.engine)
    values.setdefault("trust_remote_code", config.trust_remote_code)
    values.setdefault("seed", config.seed)
    if config.num_gpus_per_actor == 0:
        values.setdefault("device", "cpu")
    try:
        EngineConfig.check(values)  # resolved on the actors, not here
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config.{exc}") from None
    return values


def check_model(config: JobConfig) -> None:
    """The model must be a local directory with a readable ``config.json``, or a hub id whose
    config transformers can fetch. Only the config is read: no weights are loaded."""
    model = config.model
    path = os.path.expanduser(model)
    if model.startswith(("/", "./", "../", "~")) or os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"config.model: {model!r} does not exist or is not a directory")
        try:
            with open(os.path.join(path, "config.json")) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"config.model: {model!r} has no config.json (not a model "
                             "directory)") from None
        except (OSError, ValueError) as exc:
            raise ValueError(f"config.model: cannot read {model!r}/config.json: {exc}") from None
        if not isinstance(data, dict) or not (data.get("model_type") or data.get("architectures")):
            raise ValueError(f"config.model: {model!r}/config.json names no model_type")
        if data.get("auto_map") and not config.trust_remote_code:
            _refuse_remote_code(model, data)
        _check_heads(config, data.get("text_config") or data)
        return
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(model, trust_remote_code=config.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any failure here means an unusable model
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"config.model: cannot load {model!r}: {first}") from None


def _check_heads(config: JobConfig, text: dict) -> None:
    """``engine.tensor_parallel_size`` against the heads of a local config.json, before any
    actor starts."""
    from actors.engine.engine_config import check_tensor_parallel

    tp, heads = config.engine.get("tensor_parallel_size", 1), text.get("num_attention_heads")
    if isinstance(tp, int) and tp > 1 and isinstance(heads, int):
        try:
            check_tensor_parallel(tp, heads, text.get("num_key_value_heads") or heads)
        except ValueError as exc:
            raise ValueError(f"config.{exc}") from None


def _refuse_remote_code(model: str, data: dict) -> None:
    """A checkpoint whose model type only its own code (``auto_map``) defines cannot load
    without ``trust_remote_code``: say so before any actor starts (nothing is executed)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if data.get("model_type") not in CONFIG_MAPPING_NAMES:
        raise ValueError(
            f"config.model: {model!r} needs its own Python code (config.json auto_map, "
            f"model_type {data.get('model_type')!r}), which runs only with trust_remote_code: "
            "true; set it only for a checkpoint you trust")


def run_job(config: ConfigLike, *, progress: bool = True, actor_cls: Any = None) -> JobResult:
    """Runs a job to the end (or resumes it) and returns its :class:`JobResult`.

    ``actor_cls`` replaces ``actors.actor.GenerationActor`` (it is constructed the same way,
    ``actor_cls(model, engine_options, first_shard=task or None)``).
    """
    started = time.perf_counter()
    config = load_config(config)
    engine = engine_options(config)
    spec = discover(config)
    check_model(config)
    output = resolve(config.output)
    shards = plan_shards(spec, config.rows_per_shard)
    manifest = Manifest.open(output, config.output_identity(),
                             plan_document(spec, shards, config.rows_per_shard))
    removed = manifest.clean_temporaries()
    if removed:
        logger.info("removed %d temporary files of an earlier run", len(removed))
    todo = [s.shard_id for s in shards if not manifest.is_committed(s.shard_id)]
    done_rows = totals(manifest.committed)["rows"]
    logger.info("%d shards planned, %d already committed", len(shards), len(shards) - len(todo))
    note = underfilled_engine(config, spec.total_rows)
    if note and todo:
        logger.warning("%s", note)
    bar = Progress(spec.total_rows, done_rows, enabled=progress)
    dispatcher = None
    try:
        if todo:
            dispatcher = _dispatch(config, spec, shards, manifest, output, bar, engine, actor_cls,
                                   todo)
        if not manifest.finished:
            manifest.finish()
    finally:
        bar.close()
    sums = totals(manifest.committed)
    seconds = time.perf_counter() - started
    result = JobResult(
        output=config.output,
        rows=sums["output_rows"],
        input_rows=sums["rows"],
        errors=sums["errors"],
        tokens=sums["output_tokens"],
        prompt_tokens=sums["prompt_tokens"],
        seconds=seconds,
        tokens_per_second=bar.tokens / max(bar.seconds, 1e-9),
        shards=len(shards),
        shards_skipped=len(shards) - len(todo),
        shards_retried=len(dispatcher.retried) if dispatcher else 0,
        shards_failed=len(dispatcher.failed) if dispatcher else 0,
        actor_share=bar.actor_share(),
    )
    logger.info("job finished: %d rows (%d errors), %d output tokens in %.1f s",
                result.rows, result.errors, result.tokens, result.seconds)
    return result


def _dispatch(config, spec, shards, manifest, output, bar, engine, actor_cls, todo):
    from jobs.cluster import actor_factory, check_resources, connect, replica_bundles
    from jobs.dispatch import Dispatcher, shards_at_once

    if actor_cls is None:
        from actors.actor import GenerationActor as actor_cls

    connect(config.ray_address)
    # a replica: one actor, or with tensor parallelism a placement group of a bundle per rank
    bundles = replica_bundles(engine, config.num_gpus_per_actor)
    ranks = len(bundles) if bundles else 1
    check_resources(config.num_actors, config.num_gpus_per_actor * ranks, ranks)

    def commit(result: ShardResult, actor: str) -> None:
        entry = {"part": result.part, "rows": result.rows, "output_rows": result.output_rows,
                 "errors": result.errors, "output_tokens": result.output_tokens,
                 "prompt_tokens": result.prompt_tokens, "attempt": result.attempt,
                 "actor": actor, "seconds": round(result.seconds, 3)}
        try:
            manifest.record(result.shard_id, entry)
        except OSError as exc:
            raise OSError(f"output: cannot update the manifest in {config.output!r}: {exc}") \
                from exc
        if result.phases:  # where the shard's time went on the actor
            logger.info("shard %d by %s: %s", result.shard_id, actor, result.timing())
        for message in result.error_messages[:1]:
            logger.warning("shard %d: %d error rows, e.g. %s", result.shard_id, result.errors,
                           message)
        bar.update(result.rows, result.output_tokens, actor)

    fill = fill_rows(config)  # 0: shards run one at a time, two per actor at once
    dispatcher = Dispatcher(
        actor_factory(actor_cls, config.model, engine, config.num_gpus_per_actor,
                      shards_at_once=shards_at_once(fill)),
        min(config.num_actors, len(todo)),
        lambda shard_id, attempt: make_task(shards[shard_id], attempt, spec, config, output),
        commit,
        config.max_shard_attempts,
        fill_rows=fill,
        on_ready=bar.actor_ready,
        bundles=bundles,
    )
    bar.add_actors(dispatcher.actors)
    dispatcher.run(todo)
    return dispatcher
