"""A throwaway ``ray start --head`` cluster on 127.0.0.1 with token auth, for submission tests."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PORT_OPTIONS = ("port", "dashboard-port", "dashboard-agent-listen-port",
                "dashboard-agent-grpc-port", "ray-client-server-port", "metrics-export-port",
                "runtime-env-agent-port", "object-manager-port", "node-manager-port")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    url: str
    token: str
    process: subprocess.Popen
    log: Path


def _wait_for_dashboard(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ray start exited with {process.returncode}")
        try:
            urllib.request.urlopen(url + "/api/version", timeout=1)
            return
        except urllib.error.HTTPError:  # 401 without a token: the dashboard is up
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the dashboard at {url} did not come up in {timeout:.0f} s")


@contextmanager
def head_cluster(num_cpus: int = 2, timeout: float = 90):
    """Starts ``ray start --head --block`` (token auth, loopback only); stops it on exit by
    signalling that one process, which stops the processes it started."""
    ports = {name: _free_port() for name in PORT_OPTIONS}
    temp = tempfile.mkdtemp(prefix="rg", dir="/tmp")  # short: Ray's socket paths are limited
    token = secrets.token_hex(16)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    env.pop("RAY_ADDRESS", None)
    log = Path(temp) / "ray-start.log"
    cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block",
           "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
           "--disable-usage-stats", "--include-dashboard=true", f"--num-cpus={num_cpus}",
           f"--temp-dir={temp}", *[f"--{k}={v}" for k, v in ports.items()]]
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        _wait_for_dashboard(url, process, timeout)
        yield Cluster(url, token, process, log)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(temp, ignore_errors=True)
