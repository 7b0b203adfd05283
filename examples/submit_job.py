"""Submit a job to a Ray cluster and wait for it (the Python form of `raygen submit --wait`).

    python examples/submit_job.py examples/job.yaml http://127.0.0.1:8265
"""

from __future__ import annotations

import sys
import time

from toolkit import job_status, submit_job


def main(config: str, address: str) -> int:
    job_id = submit_job(config, address)  # token: --token / RAY_AUTH_TOKEN / ~/.ray/auth_token
    print("submitted", job_id)
    status = job_status(job_id, address)
    while not status.finished:
        time.sleep(5)
        status = job_status(job_id, address)
    print(status.logs)
    print(job_id, status.status)
    return 0 if status.status == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:8265"))
