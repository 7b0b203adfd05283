from types import SimpleNamespace

import pytest

from tests.jobs.acceptance_data import DEFAULTS, RELIABILITY_ENGINE, write_reliability_input
from tests.jobs.helpers import local_ray_session, read_output


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray (2 CPUs, 127.0.0.1) for every test of the session that needs it."""
    yield from local_ray_session()


@pytest.fixture(scope="session")
def reliability_job(ray_local, tiny_llama, tmp_path_factory):
    """The 2,000-row job of the fault tests (20 shards, real engine, tiny model), run once
    without faults. ``config(output, **changes)`` builds its config for another output
    directory; ``table`` is the clean run's output sorted by (id, sample_index)."""
    from jobs.runner import run_job

    root = tmp_path_factory.mktemp("reliability")
    input_dir = write_reliability_input(root / "in")

    def config(output, **changes) -> dict:
        return {"model": tiny_llama, "input": str(input_dir), "output": str(output),
                "num_actors": 2, "num_gpus_per_actor": 0, "rows_per_shard": 100, "seed": 99,
                "sampling_params": DEFAULTS, "engine": RELIABILITY_ENGINE, **changes}

    result = run_job(config(root / "clean"), progress=False)
    return SimpleNamespace(root=root, config=config, result=result,
                           table=read_output(root / "clean"))
