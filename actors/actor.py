"""GenerationActor: one model + engine per process; a plain class that callers wrap with
``ray.remote`` (``ray.remote(num_gpus=1)(GenerationActor)``) or use directly. With
``tensor_parallel_size`` > 1 it is rank 0 of a replica: scheduled in bundle 0 of a placement
group of a bundle per rank (a job's or a ``RolloutPool``'s replica), its engine starts the
other ranks as Ray actors in the other bundles, elsewhere as child processes
(``docs/tensor_parallel.md``)."""

from __future__ import annotations

import gc
import logging
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

from actors.engine.engine_config import EngineConfig
from actors.engine.generation_output import GenerationOutput

logger = logging.getLogger(__name__)

Prompt = Any  # str | list[int] | list[dict] (chat messages)


# Shard threads read rows and build part files (Python work) while the server's loop thread
# drives the engine. A thread waiting for the GIL gets it only after the holder's switch
# interval (5 ms by default): each time the loop blocks on the device it could lose ~a decode
# step's worth of time to a shard thread. 0.5 ms keeps the loop ahead of the GPU. The interval
# is process-wide, so it is set once, when an actor's process starts, never in a caller's.
SWITCH_INTERVAL_S = 0.0005


def shorten_switch_interval() -> None:
    """Sets the process's GIL switch interval to ``SWITCH_INTERVAL_S`` unless already shorter."""
    if sys.getswitchinterval() > SWITCH_INTERVAL_S:
        sys.setswitchinterval(SWITCH_INTERVAL_S)


class GenerationActor:
    """Loads the model once and generates with it.

    Args:
        model: local directory or hub id.
        engine_config: an ``EngineConfig``, a dict of its fields, or None for the defaults.
        first_shard: a job's ``ShardTask`` this actor will be asked to run first: its rows are
            read and its requests built while the model loads (``actors.shard.ShardPrefetch``),
            and its ``process_shard`` call starts generating at once.

    Example:
        >>> actor = GenerationActor("/tmp/tiny-llama", {"max_num_seqs": 8})  # doctest: +SKIP
        >>> outs = actor.generate(["Hello"], {"max_tokens": 4, "seed": 1})  # doctest: +SKIP
    """

    def __init__(self, model: str, engine_config: EngineConfig | Mapping[str, Any] | None = None,
                 *, first_shard: Any = None):
        started = time.perf_counter()
        bytecode = None
        in_ray = _in_ray_actor()
        if in_ray:
            bytecode = cache_bytecode()
            shorten_switch_interval()
        with collector_paused(in_ray):
            if in_ray:
                # one progress bar per actor, forwarded to the driver's terminal, helps nobody
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()
            from actors.engine.llm_engine import Engine
            from actors.engine.model.loader import import_transformers
            from actors.shard import ShardPrefetch, warm_up_io

            import_transformers()
        imported = time.perf_counter()
        self.model = str(model)
        self.engine_config = EngineConfig.coerce(engine_config)
        # imports done above: the thread imports nothing the model load imports meanwhile
        self._prefetch = ShardPrefetch(first_shard) if first_shard is not None else None
        try:
            self.engine = Engine(self.model, self.engine_config)
        except BaseException:
            if self._prefetch is not None:
                self._prefetch.cancel()
            raise
        if self._prefetch is not None:
            self._prefetch.engine_ready(self.engine)
        built = time.perf_counter()
        warm = 0.0
        if self.engine.loaded.device.type == "cuda":  # kernels compiled before real work
            warm = self.engine.warm_up()
        io_warm = warm_up_io()  # the first shard's part file then costs what the others do
        # what is alive now (modules, model, engine) lives as long as the actor: keep it out
        # of the collector's full passes, which otherwise walk it while the engine loop waits
        gc.collect()
        gc.freeze()
        age = _process_age_s()
        self.startup = {"process_age": age, "process_cpu": time.process_time(),
                        "engine_import": imported - started,
                        "engine_build": built - imported, "warm_up": warm,
                        "io_warm_up": io_warm,
                        **{f"build_{k}": v for k, v in self.engine.startup.items()}}
        if bytecode is not None:
            logger.info("GenerationActor: compiled bytecode cached under %s", bytecode)
        logger.info("GenerationActor ready (startup seconds %s): %s", self.startup, self.info())

    def startup_report(self) -> dict[str, float | None]:
        """Seconds the actor took to start: ``process_age`` (process start to ready, imports and
        Ray included), ``process_cpu`` (the CPU time the process had by then: well below
        ``process_age``, it waited for a CPU or for Ray), ``engine_import``, ``engine_build``
        (model load, KV pool, graph capture), ``warm_up`` (CUDA only), ``io_warm_up``
        (``actors.shard.warm_up_io``), and the engine build's phases as ``build_<phase>``
        (``Engine.startup``)."""
        return dict(self.startup)

    def generate(self, prompts: Sequence[Prompt], params: Any = None) -> list[GenerationOutput]:
        """Generates for ``prompts`` (strings, token-id lists or chat message lists).

        ``params`` is one SamplingParams / dict for every prompt, or a list with one per
        prompt. Returns one output per (prompt, sample), in prompt order then sample_index;
        the request ids are the prompt positions 0..len(prompts)-1.
        """
        per_prompt = params_per_prompt(params, len(prompts))
        requests = [(i, prompt, p) for i, (prompt, p) in enumerate(zip(prompts, per_prompt))]
        return self.engine.generate(requests)

    def info(self) -> dict[str, Any]:
        """Model and engine facts (for logs and the job driver)."""
        return self.engine.info()

    # ------------------------------------------------------------------ RL rollouts
    def generate_table(self, prompts: Sequence[Prompt], params: Sequence[Any],
                       ids: Sequence[Any], *, logprob_columns: Sequence[str] = (),
                       id_type: Any = None) -> Any:
        """Generates for ``prompts`` (one params per prompt, prepared by
        ``actors.rollout_table.prepare_params``) and returns a ``pyarrow.Table`` with the job output
        columns (``id`` from ``ids``, of ``id_type``) plus ``logprob_columns``
        (``actors.rollout_table.LOGPROB_COLUMNS``), one row per (prompt, sample) in prompt order."""
        import pyarrow as pa

        from actors.rollout_table import canonical_columns, rollout_table

        columns = canonical_columns(logprob_columns)
        token_logprobs = bool({"raw_logprobs", "temperature_logprobs"} & set(columns))
        outputs = self.engine.generate(
            [(i, prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params))],
            token_logprobs=token_logprobs)
        id_type = id_type if id_type is not None else pa.array(list(ids)).type
        return rollout_table(outputs, ids, id_type, columns)

    def update_weights(self, weights: Any) -> dict[str, Any]:
        """``Engine.update_weights`` (a state dict, ``WeightPayload`` or list of pairs; an
        ``ObjectRef`` passed to a Ray actor arrives resolved)."""
        return self.engine.update_weights(weights)

    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{state-dict name: (shape, dtype)}`` of the model's loadable tensors."""
        return self.engine.weights.spec()

    def sleep(self, level: int = 1) -> dict[str, int]:
        """``Engine.sleep``: frees the KV cache (level 1) and the weights (level 2)."""
        return self.engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """``Engine.wake_up``."""
        self.engine.wake_up(tags)

    def reset_prefix_cache(self) -> None:
        """``Engine.reset_prefix_cache``."""
        self.engine.reset_prefix_cache()

    def process_shard(self, task: Any) -> Any:
        """Runs one job shard (``actors.shard.ShardTask``) through this actor's engine, writes
        its part file and returns the ``ShardResult``. Several calls may run at once (a Ray
        actor with ``max_concurrency`` > 1): they share one background engine loop, which
        runs a ``task.deterministic`` shard alone (``actors.serving``)."""
        from functools import partial

        from actors.serving import server_for
        from actors.shard import process_shard

        server = server_for(self, self.engine)
        stats: dict[str, float] = {}
        # the first shard, read while the model loaded (None for any other, or a second time)
        prepared = self._prefetch.take(task) if self._prefetch is not None else None
        result = process_shard(task, partial(server.run, exclusive=task.deterministic,
                                             stats=stats), prepared)
        result.engine = stats
        return result


def params_per_prompt(params: Any, count: int) -> list:
    """One params value per prompt: a list/tuple of exactly ``count`` entries, else the same
    value repeated."""
    if isinstance(params, (list, tuple)):
        if len(params) != count:
            raise ValueError(f"params: got {len(params)} entries for {count} prompts")
        return list(params)
    return [params] * count


@contextmanager
def collector_paused(enabled: bool = True) -> Iterator[None]:
    """Runs the block (an actor's imports) with the cyclic garbage collector off, then freezes
    every object alive (``gc.freeze``) and turns the collector back on. Imports add objects
    that live as long as the process (modules, classes, functions), which the collector would
    walk again and again while they grow; frozen, no later collection walks them either. The
    cyclic garbage the imports left is frozen with them, never freed. ``enabled=False``: the
    block runs as is."""
    if not enabled:
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def cache_bytecode() -> str | None:
    """Lets this process cache the bytecode it compiles when the environment forbids writing
    it next to the sources (``PYTHONDONTWRITEBYTECODE``, common in container images, several
    of which also ship torch without ``.pyc`` files): every actor start would otherwise
    compile torch and transformers from source again. The cache is a separate directory
    (``sys.pycache_prefix``): ``$RAYGEN_PYCACHE``, default ``<tmp>/raygen-pycache-<uid>``;
    ``RAYGEN_PYCACHE=off`` leaves the process as it is. The directory is made private (0700)
    and refused unless it belongs to this user and no one else may write it. Returns the
    directory in use, or None when nothing changed."""
    if not sys.dont_write_bytecode or sys.pycache_prefix is not None:
        return None
    path = os.environ.get("RAYGEN_PYCACHE",
                          os.path.join(tempfile.gettempdir(), f"raygen-pycache-{os.getuid()}"))
    if path.lower() in ("", "0", "off", "false", "no"):
        return None
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError:
        return None
    # bytecode found there is executed: only a directory of ours that no one else may write
    if st.st_uid != os.getuid() or st.st_mode & 0o022 or not os.access(path, os.W_OK):
        logger.warning("not caching bytecode in %s: it must belong to this user and be "
                       "writable by no one else", path)
        return None
    sys.pycache_prefix = path  # read by the import system at every later import
    sys.dont_write_bytecode = False
    return path


def _in_ray_actor() -> bool:
    """Whether this process is a Ray actor (a process of its own; not a driver or a test)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    try:
        return ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - an older or partial Ray: leave the process as it is
        return False


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), or None."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
