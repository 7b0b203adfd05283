"""``raygen demo``: a whole job on a local Ray with a tiny model built on first use (no hub).

The model (random weights, a tokenizer trained on the spot, see ``toolkit.tiny_model``) is
cached under ``$RAYGEN_CACHE`` (default ``$XDG_CACHE_HOME/raygen`` or ``~/.cache/raygen``); the
prompts are the bundled ``toolkit/data/demo_prompts.parquet`` with mixed per-row params.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from jobs.config import JobConfig
from jobs.progress import JobResult

logger = logging.getLogger(__name__)

DEMO_MODEL = "tiny-llama"


def cache_dir() -> Path:
    """Where the demo keeps its model."""
    if os.environ.get("RAYGEN_CACHE"):
        return Path(os.environ["RAYGEN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "raygen"


def demo_model(cache: Path | None = None) -> Path:
    """The demo model directory, built (into a temporary directory, then renamed into place so
    an interrupted build leaves nothing half-written) when missing."""
    from toolkit.tiny_model import build_tiny_model

    target = (cache or cache_dir()) / DEMO_MODEL
    if (target / "raygen_tiny.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    logger.info("building the demo model in %s (first use only)", target)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" for a model of one file
    try:
        build_tiny_model(staging, "llama", seed=0)
        shutil.rmtree(target, ignore_errors=True)  # a directory without the marker: incomplete
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if bars:
            hf_logging.enable_progress_bar()
    return target


def demo_prompts() -> str:
    """Path of the bundled demo prompts."""
    return str(resources.files("toolkit") / "data" / "demo_prompts.parquet")


def demo_config(output: str, model: str, num_actors: int) -> JobConfig:
    """The demo job: CPU actors, small shards, short outputs."""
    return JobConfig(
        model=model,
        input=demo_prompts(),
        output=output,
        num_actors=num_actors,
        num_gpus_per_actor=0,
        rows_per_shard=4,
        seed=0,
        ray_address="local",
        sampling_params={"max_tokens": 12, "temperature": 1.0},
        engine={"max_num_seqs": 4, "max_model_len": 256},  # a shard's rows at once
    )


def run_demo(output: str = "demo-out", *, cache: Path | None = None,
             num_actors: int | None = None) -> JobResult:
    """Builds the model if needed, clears a previous demo output, runs the demo job."""
    from jobs.manifest import LEGACY_MANIFEST, MANIFEST
    from jobs.runner import run_job

    out = Path(output)
    # a previous demo: start over so it really generates
    if (out / MANIFEST).is_file() or (out / LEGACY_MANIFEST).is_file():
        shutil.rmtree(out)
    model = demo_model(cache)
    actors = num_actors or max(1, min(2, os.cpu_count() or 1))
    return run_job(demo_config(str(out), str(model), actors))
