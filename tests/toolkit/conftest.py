import pytest

from tests.jobs.helpers import local_ray_session


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray (2 CPUs, 127.0.0.1) for every test of the session that needs it."""
    yield from local_ray_session()
