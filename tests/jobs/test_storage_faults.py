"""Output storage faults (issue 8): the output fills up or turns read-only in the middle of a
job. The job ends with one clear ``output: ...`` error naming the errno, the manifest stays
valid, and a rerun, once the storage is healthy again, resumes from it (committed shards
skipped) and ends with the rows of a clean run.

Each fault runs on a real tmpfs when this machine lets the test mount one (root in a
privileged container), else on the simulated storage of ``tests/jobs/faultfs.py`` (the same
faults through an fsspec filesystem); ``test_simulated_storage_fails_like_a_disk`` checks
the simulation itself everywhere.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time

import pytest

from actors.serving import EngineServer
from actors.shard import process_shard
from jobs.config import JobConfig
from jobs.sources import discover
from jobs.manifest import SUCCESS, read_manifest
from jobs.plan import make_task, plan_shards
from jobs.runner import run_job
from jobs.storage import resolve
from tests.jobs.fakes import FakeActor, FakeEngine, SlowFakeActor
from tests.jobs.faultfs import MESSAGES, SimulatedStorage, TmpfsStorage
from tests.jobs.helpers import read_output, temporaries, write_parquet

pytestmark = pytest.mark.ray

SHARDS = 20


def _config(tiny_llama, input_dir, output) -> dict:
    return {"model": tiny_llama, "input": str(input_dir), "output": output, "num_actors": 2,
            "num_gpus_per_actor": 0, "rows_per_shard": 7,
            "sampling_params": {"max_tokens": 6, "logprobs": 1}}


@pytest.fixture(scope="module")
def clean(tiny_llama, tmp_path_factory):
    """The input, and its clean output made in-process shard by shard (the fake engine's
    rows depend only on the request)."""
    root = tmp_path_factory.mktemp("storage-faults")
    write_parquet(root / "in" / "a.parquet",
                  [{"id": i, "prompt": f"prompt number {i}", "tag": f"t{i}"}
                   for i in range(7 * SHARDS)])
    config = JobConfig.from_dict(_config(tiny_llama, root / "in", str(root / "clean")))
    spec, output = discover(config), resolve(config.output)
    output.fs.create_dir(output.path)
    for shard in plan_shards(spec, config.rows_per_shard):
        process_shard(make_task(shard, 1, spec, config, output), EngineServer(FakeEngine()).run)
    return root / "in", read_output(root / "clean")


@pytest.fixture
def storage(tmp_path):
    """A real tmpfs where this machine lets the test mount one, else (or with
    ``RAYGEN_TEST_STORAGE=simulated``) the simulated one."""
    try:
        if os.environ.get("RAYGEN_TEST_STORAGE") == "simulated":
            raise PermissionError("RAYGEN_TEST_STORAGE=simulated")
        store = TmpfsStorage(tmp_path)
    except (PermissionError, OSError) as exc:
        logging.getLogger(__name__).info("no tmpfs (%s): simulated storage", exc)
        store = SimulatedStorage(tmp_path)
    yield store
    store.close()


def _fail_after_commits(store, mode: str, commits: int) -> threading.Thread:
    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                done = len(read_manifest(store.out_dir)["committed"])
            except (OSError, ValueError):
                done = 0
            if done >= commits:
                store.fail(mode)
                return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("mode", ["full", "readonly"])
def test_storage_fault_mid_job_ends_clearly_and_rerun_resumes(ray_local, clean, storage,
                                                             tiny_llama, mode):
    input_dir, clean_table = clean
    config = _config(tiny_llama, input_dir, storage.output)
    watcher = _fail_after_commits(storage, mode, commits=2)
    with pytest.raises(OSError) as failure:
        run_job(config, actor_cls=SlowFakeActor, progress=False)
    watcher.join(timeout=5)
    message = str(failure.value)
    assert re.match(r"output: (shard \d+: cannot write \S+part-\d{5}\.parquet|cannot update "
                    r"the manifest in \S+): ", message), message
    assert MESSAGES[mode] in message, message

    storage.heal()
    committed = read_manifest(storage.out_dir)["committed"]
    assert 2 <= len(committed) < SHARDS and not (storage.out_dir / SUCCESS).exists()
    result = run_job(config, actor_cls=FakeActor, progress=False)
    assert result.shards_skipped == len(committed) and result.shards == SHARDS
    assert (storage.out_dir / SUCCESS).exists()
    assert not temporaries(storage.out_dir)
    assert read_output(storage.out_dir).equals(clean_table)


def test_simulated_storage_fails_like_a_disk(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.storage import write_atomic

    store = SimulatedStorage(tmp_path)
    loc = resolve(store.output)
    loc.fs.create_dir(loc.path)
    write_atomic(loc.fs, loc.join("a"), b"fine")
    store.fail("full")
    with pytest.raises(OSError) as full:
        pq.write_table(pa.table({"x": [1]}), loc.join("b.parquet"), filesystem=loc.fs)
    assert full.value.errno == errno.ENOSPC or MESSAGES["full"] in str(full.value)
    loc.fs.move(loc.join("a"), loc.join("c"))  # a full disk still renames
    store.fail("readonly")
    for action in (lambda: loc.fs.move(loc.join("c"), loc.join("d")),
                   lambda: loc.fs.delete_file(loc.join("c")),
                   lambda: write_atomic(loc.fs, loc.join("e"), b"x")):
        with pytest.raises(OSError, match=MESSAGES["readonly"]):
            action()
    store.heal()
    write_atomic(loc.fs, loc.join("e"), b"back")
    names = {p.name for p in store.out_dir.iterdir()}
    assert {"c", "e"} <= names and not {"a", "d"} & names
    assert (store.out_dir / "e").read_bytes() == b"back"
