"""Shared by the benchmark smoke tests."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as a module (the directory is no package)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def written_as_returned(path: Path, result: object) -> bool:
    """Whether the JSON a benchmark wrote to ``path`` is what its ``main`` returned."""
    return json.loads(path.read_text()) == json.loads(json.dumps(result, default=str))
