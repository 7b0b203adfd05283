"""Where the ``raygen`` command's log records go: the terminal shows warnings (and the
progress lines of a run without a TTY), a log file gets every record at INFO or more.

The log file is ``raygen-<time>-<pid>.log`` in the Ray session's log folder once the run has
connected to Ray (beside Ray's own logs: ``/tmp/ray/session_latest/logs``), else in
``$TMPDIR/raygen-logs``. ``-v`` (INFO) or ``--log-level`` shows more on the terminal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import time
from typing import Iterator

PACKAGES = ("jobs", "actors", "toolkit", "sampler")
PROGRESS_LOGGER = "jobs.progress"  # its INFO lines are the progress of a run without a TTY
_FORMAT = "%(levelname)s %(name)s: %(message)s"


class _ConsoleFormat(logging.Formatter):
    """``raygen: <message>`` for progress lines, ``LEVEL logger: <message>`` for the rest."""

    def __init__(self) -> None:
        super().__init__(_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        if record.name == PROGRESS_LOGGER and record.levelno == logging.INFO:
            return f"raygen: {record.getMessage()}"
        return super().format(record)


class _Console(logging.Filter):
    """Records at the terminal's level, and the progress lines."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level or (record.name == PROGRESS_LOGGER
                                                and record.levelno >= logging.INFO)


class SessionLogFile(logging.Handler):
    """Keeps records in memory until Ray is connected, then writes them (and every later one)
    to a file in the Ray session's log folder; ``path`` opens the file where it stands."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self._early: list[logging.LogRecord] = []
        self._file: logging.FileHandler | None = None
        self.setFormatter(logging.Formatter("%(asctime)s " + _FORMAT))

    @property
    def path(self) -> str:
        """The log file (opened now, in the temporary folder, if Ray never connected)."""
        return self._open(_session_logs() or _temp_logs()).baseFilename

    def _open(self, folder: str) -> logging.FileHandler:
        if self._file is None:
            name = f"raygen-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
            self._file = logging.FileHandler(os.path.join(folder, name), delay=False)
            self._file.setFormatter(self.formatter)
            for record in self._early:
                self._file.emit(record)
            self._early.clear()
        return self._file

    def emit(self, record: logging.LogRecord) -> None:
        if self._file is None:
            folder = _session_logs()
            if folder is None:
                self._early.append(record)
                return
            self._open(folder)
        self._file.emit(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        super().close()


def _session_logs() -> str | None:
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        from ray._private.worker import _global_node

        folder = _global_node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 - a Ray without this internal: the temporary folder
        return None
    return folder if folder and os.path.isdir(folder) else None


def _temp_logs() -> str:
    folder = os.path.join(tempfile.gettempdir(), "raygen-logs")
    os.makedirs(folder, exist_ok=True)
    return folder


@contextlib.contextmanager
def configured(level: int = logging.WARNING, *,
               log_file: bool = True) -> Iterator[SessionLogFile | None]:
    """The command's logging while the block runs: the terminal at ``level`` (plus progress
    lines) and, with ``log_file``, a :class:`SessionLogFile` at INFO (DEBUG when ``level`` is
    DEBUG), which the block gets. Everything is put back afterwards."""
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(_ConsoleFormat())
    console.addFilter(_Console(level))
    root = logging.getLogger()
    added: list[logging.Handler] = [console]
    handler = None
    if log_file:
        handler = SessionLogFile()
        handler.setLevel(min(level, logging.INFO))
        added.append(handler)
    loggers = [logging.getLogger(name) for name in PACKAGES]
    before = [(lg, lg.level) for lg in loggers]
    for h in added:
        root.addHandler(h)
    for lg in loggers:
        lg.setLevel(min(level, logging.INFO))
    try:
        yield handler
    finally:
        for h in added:
            root.removeHandler(h)
            h.close()
        for lg, old in before:
            lg.setLevel(old)
