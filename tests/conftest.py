import os

# Tests never reach a model hub, and Ray (when a test starts it) listens on loopback only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Tiny models run fastest on one thread, and CI machines are shared: set before torch loads, so
# every thread (and every CPU engine, actors.engine.cpu_threads) starts from one.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Without a GPU, Triton kernels run under the interpreter (set before triton is imported).
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Builds (once per session) a random-weight model + trained tokenizer directory.

    Usage: ``path = tiny_model_factory("qwen2", sliding_window=8)``.
    """
    from toolkit.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[tuple, str] = {}

    def make(arch: str = "llama", **kwargs) -> str:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in built:
            name = arch + "".join(f"-{k}{v}" for k, v in sorted(kwargs.items()))
            built[key] = str(build_tiny_model(root / name, arch, **kwargs))
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")
