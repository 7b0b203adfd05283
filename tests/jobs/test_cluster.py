"""A replica's resources: its placement-group bundles and the early refusal of a cluster that
cannot hold it (Ray's resource views replaced by fakes: no Ray started); the end of a local
Ray session (a Ray of its own, in a child process)."""

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


_END_LOCAL_RAY = """
import json
import sys
import ray
from ray._private import node as ray_node
from jobs.cluster import connect, disconnect

connect("local")
node = ray._private.worker._global_node
processes = {kind: [info.process for info in infos] for kind, infos in node.all_processes.items()}
order = []
kill = ray_node.Node._kill_process_type

def spy(self, kind, **kw):  # Ray's shutdown, one process kind at a time
    order.append((kind, [p.poll() for p in processes["monitor"]]))
    result = kill(self, kind, **kw)
    if kind == "log_monitor":  # the last kind Ray stops
        print(json.dumps({"order": order, "ended": {k: [p.poll() for p in ps]
                                                    for k, ps in processes.items()}}),
              flush=True)
    return result

ray_node.Node._kill_process_type = spy
if sys.argv[1] == "disconnect":
    disconnect()
"""


@pytest.mark.ray
@pytest.mark.parametrize("how", ["disconnect", "exit"])
def test_the_local_ray_ends_with_its_monitor_killed_first(how):
    """Whether the session ends by ``disconnect`` (the CLI after a run) or at the
    interpreter's exit (Ray's exit hook), the local Ray's autoscaler monitor is killed before
    Ray's shutdown stops the raylet and the GCS (stopped after them, it waits for the GCS
    until the shutdown kills it), and every process of that Ray has ended."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    run = subprocess.run([sys.executable, "-c", _END_LOCAL_RAY, how], capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    first_kind, monitor_then = result["order"][0]
    assert first_kind == "raylet" and monitor_then == [-9]  # SIGKILLed before the raylet
    assert "monitor" in result["ended"]
    assert all(code is not None for kind, codes in result["ended"].items() for code in codes
               if kind != "log_monitor")  # (the last one, stopped as this is printed)
    assert "autoscaler failed" not in run.stderr
