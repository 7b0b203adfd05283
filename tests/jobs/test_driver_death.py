"""Driver death (issue 8): the driver of the 2,000-row job SIGKILLs itself at a commit-protocol
point (``RAYGEN_TEST_FAULTS``, off by default); a rerun finishes with the rows of a clean run,
bit for bit, skipping what was committed; temporaries left behind are ignored by readers and
removed; another config is refused on that directory.

The third point, mid-job (SIGKILL from outside after some commits), is
``test_acceptance.py::test_resume_after_killing_the_driver``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import yaml

from jobs.manifest import FAULTS_ENV, MANIFEST, STATE_DIR, SUCCESS, read_manifest
from jobs.runner import run_job
from tests.jobs.helpers import assert_identical, part_stats, read_output

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _killed_run(config: dict, path, point: str) -> subprocess.CompletedProcess:
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, FAULTS_ENV: f"kill-driver@{point}"}
    return subprocess.run([sys.executable, "-m", "toolkit.cli", "run", str(path),
                           "--no-progress"], env=env, capture_output=True, text=True,
                          timeout=400)


def _hidden(out) -> list[str]:
    """The hidden files (temporaries) beside the parts and among the markers."""
    return sorted(p.name for folder in (out, out / STATE_DIR) for p in folder.iterdir()
                  if p.name.startswith(".") and p.is_file())


@pytest.mark.parametrize("point", ["first-commit", "final-manifest"])
def test_driver_killed_then_rerun_gives_the_clean_rows(reliability_job, ray_local, tmp_path,
                                                       point):
    out = tmp_path / "out"
    config = reliability_job.config(out, ray_address=ray_local.get_runtime_context()
                                    .gcs_address)
    killed = _killed_run(config, tmp_path / "job.yaml", point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert f"killing the driver at {point}" in killed.stderr

    manifest = read_manifest(out)
    committed = manifest["committed"]
    assert not (out / SUCCESS).exists() and "finished" not in manifest
    assert ".manifest.parquet.tmp" in _hidden(out)  # the rename that never happened
    if point == "first-commit":
        assert committed == {}  # a part file is in place, its commit was never recorded
        assert list(out.glob("part-*.parquet"))
        (out / ".part-00007-1.parquet.tmp").write_bytes(b"PAR1 half of a part file")
        assert pq.read_table(out).num_rows > 0  # readers skip the temporaries
        before = (out / MANIFEST).read_bytes()
        with pytest.raises(ValueError, match=r"holds the manifest of a job with a different "
                                             r"configuration \(differs in: sampling_params\)"):
            run_job({**config, "sampling_params": {"max_tokens": 5}}, progress=False)
        assert (out / MANIFEST).read_bytes() == before and ".manifest.parquet.tmp" in _hidden(out)
    else:
        assert sorted(map(int, committed)) == list(range(20))
    parts_before = part_stats(out)

    result = run_job({**config, "ray_address": None}, progress=False)
    assert result.shards_skipped == len(committed) and result.errors == 0
    after = part_stats(out)
    for entry in committed.values():  # committed shards were not recomputed
        assert after[entry["part"]] == parts_before[entry["part"]]
    assert len(after) == 20 and (out / SUCCESS).exists() and _hidden(out) == []
    assert "finished" in read_manifest(out)
    assert_identical(read_output(out), reliability_job.table)
