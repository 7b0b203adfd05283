import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The sampler tests use small tensors: one intra-op thread avoids OpenMP spinning on a
    busy 2-core machine (ten times slower there). Restored after each module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
