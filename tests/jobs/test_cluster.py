"""A replica's resources: its placement-group bundles and the early refusal of a cluster that
cannot hold it (Ray's resource views replaced by fakes: no Ray started)."""

from __future__ import annotations

import pytest
import ray

from jobs.cluster import check_resources, replica_bundles


def test_a_bundle_per_rank_and_none_for_one_rank():
    assert replica_bundles({}, 1) is None
    assert replica_bundles({"tensor_parallel_size": 1}, 0.5) is None
    assert replica_bundles({"tensor_parallel_size": 3}, 0.5) == [{"CPU": 1.0, "GPU": 0.5}] * 3
    assert replica_bundles({"tensor_parallel_size": 2}, 0) == [{"CPU": 1.0}] * 2  # CPU ranks
    assert replica_bundles({"tensor_parallel_size": 2}, 1, 2) == [{"CPU": 2.0, "GPU": 1.0}] * 2


@pytest.fixture
def two_nodes(monkeypatch):
    """A fake cluster of two nodes with 2 GPUs and 4 CPUs each."""
    node = {"Alive": True, "Resources": {"GPU": 2.0, "CPU": 4.0}}
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 4.0, "CPU": 8.0})
    monkeypatch.setattr(ray, "nodes", lambda: [node, dict(node)])


def test_a_replica_must_fit_on_one_node(two_nodes):
    check_resources(2, 2, 2)  # two replicas of two ranks: one per node
    with pytest.raises(ValueError, match=r"config\.num_gpus_per_actor: a replica needs 4 GPUs "
                                         r"and 4 CPUs on one node"):
        check_resources(1, 4, 4)  # the cluster has 4 GPUs, but no node holds them all
    with pytest.raises(ValueError, match=r"config\.num_actors: 3 actors x 2 GPUs"):
        check_resources(3, 2, 2)
    with pytest.raises(ValueError, match=r"config\.num_actors: 3 actors x 3 CPUs need 9 CPUs"):
        check_resources(3, 0, 3)
