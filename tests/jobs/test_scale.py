"""Memory and scale (issue 8): a 50,000-row job (max_tokens=1, tiny model, 2 CPU actors) run
by the ``raygen`` CLI in its own process. The driver streams: its resident memory, sampled
from /proc while the job runs, stays below 500 MB and flat while shards commit. Rows/s is
printed (``-s``) and recorded in docs/reliability.md.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from jobs.manifest import MANIFEST, parse_manifest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROWS = 50_000
SHARD = 2_500
LIMIT_MB = 500
FLAT_MB = 40  # the most the driver may grow from the first to the last commits


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class _Sampler(threading.Thread):
    """(seconds, RSS MB, committed shards) of the driver every 50 ms while it lives."""

    def __init__(self, pid: int, manifest) -> None:
        super().__init__(daemon=True)
        self.pid, self.manifest = pid, manifest
        self.samples: list[tuple[float, float, int]] = []

    def _committed(self) -> int:
        try:
            return len(parse_manifest(self.manifest.read_bytes())["committed"])
        except (OSError, ValueError):
            return 0

    def run(self) -> None:
        start = time.monotonic()
        while (rss := _rss_mb(self.pid)) is not None:
            self.samples.append((time.monotonic() - start, rss, self._committed()))
            time.sleep(0.05)


def test_fifty_thousand_rows_with_a_small_flat_driver(ray_local, tiny_llama, tmp_path):
    words = "the quick brown fox jumps over lazy dog".split()
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({
        "id": pa.array([f"q{i:05d}" for i in range(ROWS)]),
        "prompt": pa.array([" ".join(words[(i + j) % 8] for j in range(2 + i % 6))
                            for i in range(ROWS)]),
    }), tmp_path / "in" / "prompts.parquet", row_group_size=SHARD)
    out = tmp_path / "out"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "model": tiny_llama, "input": str(tmp_path / "in"), "output": str(out),
        "num_actors": 2, "num_gpus_per_actor": 0, "rows_per_shard": SHARD,
        "sampling_params": {"max_tokens": 1}, "ray_address":
            ray_local.get_runtime_context().gcs_address,
        "engine": {"max_num_seqs": 256, "max_model_len": 64, "num_kv_blocks": 1024}}))
    driver = subprocess.Popen([sys.executable, "-m", "toolkit.cli", "run",
                               str(tmp_path / "job.yaml"), "--no-progress"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = _Sampler(driver.pid, out / MANIFEST)
    sampler.start()
    stdout, stderr = driver.communicate(timeout=500)
    sampler.join(timeout=5)
    assert driver.returncode == 0, stderr[-3000:]
    seconds = float(re.search(r"time:\s+([\d.]+) s", stdout).group(1))
    assert f"{ROWS} output rows for {ROWS} input rows, 0 errors" in stdout, stdout
    assert pq.ParquetDataset(str(out)).read(columns=["id"]).num_rows == ROWS

    samples = sampler.samples
    peak = max(rss for _, rss, _ in samples)
    shards = ROWS // SHARD
    during = [rss for _, rss, done in samples if 1 <= done < shards]
    first = [rss for _, rss, done in samples if 1 <= done <= shards // 4]
    last = [rss for _, rss, done in samples if done >= 3 * shards // 4]
    print(f"\n{ROWS} rows in {seconds:.1f} s: {ROWS / seconds:.0f} rows/s (whole job, actor "
          f"start included); driver RSS peak {peak:.0f} MB, while committing "
          f"{min(during):.0f}-{max(during):.0f} MB over {len(samples)} samples")
    assert peak < LIMIT_MB
    assert len(first) >= 3 and len(last) >= 3, samples  # sampled through the whole job
    assert max(last) - max(first) < FLAT_MB, (max(first), max(last))
