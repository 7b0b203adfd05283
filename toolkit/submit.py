"""Submitting a job to a Ray cluster through the Ray Jobs API, and asking how it goes.

The config travels in the job's ``working_dir`` (with local paths made absolute) and raygen's
packages travel as ``py_modules``, so the cluster needs Ray and raygen's dependencies but not
raygen itself. The job's driver runs ``python -m toolkit.cli run job.yaml`` on the cluster.

Token authentication: the token is taken from ``token=``, else ``RAY_AUTH_TOKEN``, else the
file named by ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``, and sent as a bearer token.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.config import ConfigLike, load_config

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
CONFIG_NAME = "job.yaml"


def _address(address: str | None) -> str:
    address = address or os.environ.get("RAY_API_SERVER_ADDRESS")
    if not address:
        env = os.environ.get("RAY_ADDRESS", "")
        address = env if env.startswith(("http://", "https://")) else DEFAULT_ADDRESS
    return address


def _token(token: str | None) -> str | None:
    if token:
        return token
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    for path in (os.environ.get("RAY_AUTH_TOKEN_PATH"), Path.home() / ".ray" / "auth_token"):
        if path and Path(path).is_file():
            return Path(path).read_text().strip() or None
    return None


class AuthTokenError(PermissionError):
    """The cluster refused a request for want of its auth token. ``option`` is how the message
    names the token option (``token=`` in Python; the CLI sets ``--token``)."""

    def __init__(self, url: str, rejected: bool, option: str = "token=") -> None:
        super().__init__(url, rejected)
        self.url, self.rejected, self.option = url, rejected, option

    def __str__(self) -> str:
        why = "the token given was rejected" if self.rejected else "none was found"
        return (f"Ray at {self.url} refused the request: it needs its auth token ({why}); pass "
                f"{self.option} or set RAY_AUTH_TOKEN")


def _client(address: str | None, token: str | None):
    from ray.job_submission import JobSubmissionClient

    url = _address(address)
    secret = _token(token)
    headers = {"Authorization": f"Bearer {secret}"} if secret else None
    try:
        return JobSubmissionClient(url, headers=headers)
    except Exception as exc:  # noqa: BLE001 - connection, HTTP and auth errors alike
        text = str(exc)
        if "401" in text or "403" in text or "uthenticat" in text or "Unauthorized" in text:
            raise AuthTokenError(url, bool(secret)) from None
        raise ConnectionError(f"cannot reach the Ray dashboard at {url}: "
                              f"{text.strip().splitlines()[0] if text.strip() else exc!r}") from None


def _absolute(value: str) -> str:
    if "://" in value:
        return value
    return os.path.abspath(os.path.expanduser(value))


def _portable_config(config: ConfigLike) -> dict[str, Any]:
    """The config as a dict whose local paths no longer depend on the client's cwd."""
    cfg = load_config(config).to_dict()
    cfg["input"] = ([_absolute(p) for p in cfg["input"]] if isinstance(cfg["input"], list)
                    else _absolute(cfg["input"]))
    cfg["output"] = _absolute(cfg["output"])
    if os.path.exists(os.path.expanduser(cfg["model"])):
        cfg["model"] = _absolute(cfg["model"])
    cfg["ray_address"] = None  # the job's driver joins the cluster it runs on
    return cfg


def _package_dirs() -> list[str]:
    """raygen's package directories (found without importing them)."""
    import importlib.util

    return [importlib.util.find_spec(name).submodule_search_locations[0]
            for name in ("toolkit", "jobs", "actors", "sampler")]


def submit_job(config: ConfigLike, address: str | None = None, *, token: str | None = None,
               job_id: str | None = None, runtime_env: dict[str, Any] | None = None) -> str:
    """Submits a job to a Ray cluster's Jobs API and returns its job (submission) id.

    Args:
        config: a JobConfig, a dict or a YAML path (checked here before anything is sent).
        address: the dashboard URL, default ``RAY_API_SERVER_ADDRESS`` / an http
            ``RAY_ADDRESS`` / ``http://127.0.0.1:8265``.
        token: the cluster's auth token (see the module docstring for the fallbacks).
        job_id: a submission id of your choice.
        runtime_env: merged over the one built here (``working_dir``, ``py_modules``).

    Example:
        >>> job = submit_job("job.yaml", "http://127.0.0.1:8265")  # doctest: +SKIP
        >>> job_status(job).status                                # doctest: +SKIP
        'RUNNING'
    """
    import yaml

    cfg = _portable_config(config)
    client = _client(address, token)
    with tempfile.TemporaryDirectory(prefix="raygen-submit-") as workdir:
        Path(workdir, CONFIG_NAME).write_text(yaml.safe_dump(cfg, sort_keys=False))
        env = {"working_dir": workdir, "py_modules": _package_dirs(),
               "excludes": ["__pycache__", "*.pyc"], **(runtime_env or {})}
        return client.submit_job(
            entrypoint=f"python -m toolkit.cli run {CONFIG_NAME}",
            runtime_env=env,
            submission_id=job_id,
            metadata={"raygen_output": cfg["output"]},
        )


@dataclass(slots=True)
class JobStatus:
    """Where a submitted job stands."""

    job_id: str
    status: str  # PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED
    message: str | None
    logs: str

    @property
    def finished(self) -> bool:
        return self.status in ("STOPPED", "SUCCEEDED", "FAILED")


def job_status(job_id: str, address: str | None = None, *, token: str | None = None) -> JobStatus:
    """The status, message and logs of a submitted job."""
    client = _client(address, token)
    try:
        info = client.get_job_info(job_id)
        logs = client.get_job_logs(job_id)
    except RuntimeError as exc:
        raise ValueError(f"job {job_id!r}: {str(exc).strip().splitlines()[0]}") from None
    status = getattr(info.status, "value", str(info.status))
    return JobStatus(job_id, str(status), info.message, logs)


@dataclass(slots=True)
class JobSummary:
    """One submitted job, as ``list_jobs`` reports it."""

    job_id: str
    status: str
    output: str | None  # the job's output directory (raygen jobs only)
    start_time: float | None  # seconds since the epoch


def list_jobs(address: str | None = None, *, token: str | None = None,
              all_jobs: bool = False) -> list[JobSummary]:
    """The cluster's raygen jobs (``all_jobs``: every Ray job), oldest first."""
    client = _client(address, token)
    out = []
    for info in client.list_jobs():
        output = (info.metadata or {}).get("raygen_output")
        if info.submission_id is None or (output is None and not all_jobs):
            continue
        status = str(getattr(info.status, "value", info.status))
        start = info.start_time / 1000 if info.start_time else None
        out.append(JobSummary(info.submission_id, status, output, start))
    return sorted(out, key=lambda j: j.start_time or 0)


def stop_job(job_id: str, address: str | None = None, *, token: str | None = None) -> bool:
    """Asks the cluster to stop a submitted job; False when it had finished already. Its
    committed shards stay: submitting the same config again resumes it."""
    client = _client(address, token)
    try:
        return bool(client.stop_job(job_id))
    except RuntimeError as exc:
        raise ValueError(f"job {job_id!r}: {str(exc).strip().splitlines()[0]}") from None
