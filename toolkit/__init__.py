"""raygen's public API: the only names users import.

Heavy modules (ray, transformers, torch kernels) load on first use of the name that needs
them, so ``import toolkit`` stays fast.
"""

__version__ = "0.1.0"

# Bound at import (toolkit/generate.py is light; the engine loads on the first call), so the
# name ``toolkit.generate`` is the function and not the submodule of the same name.
from toolkit.generate import generate  # noqa: E402,F401

# Everything else loads on first access (module __getattr__, PEP 562).
_LAZY = {
    "SamplingParams": "sampler.params",
    "StructuredOutputsParams": "sampler.structured_params",
    "GenerationOutput": "actors.engine.generation_output",
    "JobConfig": "jobs.config",
    "JobResult": "jobs.progress",
    "run_job": "jobs.runner",
    "submit_job": "toolkit.submit",
    "job_status": "toolkit.submit",
    "RolloutPool": "toolkit.rollout",
    "run_batch": "toolkit.batch",
}

__all__ = ["GenerationOutput", "JobConfig", "JobResult", "RolloutPool", "SamplingParams",
           "StructuredOutputsParams", "generate", "job_status", "run_batch", "run_job",
           "submit_job"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'toolkit' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
