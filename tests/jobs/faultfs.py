"""Output storage that fails on demand, for the storage fault tests (test code only).

Two kinds behind one interface (``output``, ``out_dir``, ``fail(mode)``, ``heal()``):

- :class:`TmpfsStorage`: a real tmpfs of a few MiB mounted for the test (needs the right to
  mount, e.g. root in a privileged container); ``fail("full")`` fills it with a ballast file
  until the kernel says ENOSPC, ``fail("readonly")`` remounts it read-only (EROFS).
- :class:`SimulatedStorage`: ``faultfs:///path``, a local directory seen through
  :class:`FaultFS`, an fsspec filesystem that the job reaches through its ordinary fsspec URI
  support. The file ``fault-mode`` beside the output directory says how writes behave, and is
  read at every write in every process (driver and actors): ``full`` (files can be created,
  not filled: ENOSPC) or ``readonly`` (no create, write, rename or delete: EROFS).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import ray.cloudpickle
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # actors get the class too

MESSAGES = {"full": os.strerror(errno.ENOSPC), "readonly": os.strerror(errno.EROFS)}


def _mode(path: str) -> str:
    for parent in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        try:
            with open(os.path.join(parent, "fault-mode")) as f:
                return f.read().strip()
        except OSError:
            continue
    return ""


def _error(code: int, path: str) -> OSError:
    return OSError(code, os.strerror(code), path)


def _faultfs_class() -> type:
    """The FaultFS class of this process, defined and registered with fsspec on first use.
    (A class object defined at module level would have to travel to the actors by value,
    and fsspec classes hold a lock that cannot be pickled; this function travels instead.)"""
    try:
        return fsspec.get_filesystem_class("faultfs")
    except ValueError:
        pass

    class FullFile(LocalFileOpener):
        def write(self, data):  # noqa: ANN001 - the file API
            raise _error(errno.ENOSPC, self.path)

    class FaultFS(LocalFileSystem):
        """Local files whose writes obey ``fault-mode`` (see the module docstring)."""

        protocol = "faultfs"

        def __reduce__(self):
            return _new_faultfs, ()

        def _check(self, path: str) -> str:
            mode = _mode(self._strip_protocol(path))
            if mode == "readonly":
                raise _error(errno.EROFS, path)
            return mode

        def _open(self, path, mode="rb", block_size=None, **kwargs):
            if any(c in mode for c in "wax+") and self._check(path) == "full":
                return FullFile(self._strip_protocol(path), mode, fs=self, **kwargs)
            return super()._open(path, mode, block_size, **kwargs)

        def mv(self, path1, path2, recursive=True, **kwargs):
            self._check(path2)
            return super().mv(path1, path2, recursive=recursive, **kwargs)

        def rm_file(self, path):
            self._check(path)
            return super().rm_file(path)

        def rm(self, path, recursive=False, maxdepth=None):
            for p in path if isinstance(path, list) else [path]:
                self._check(p)
            return super().rm(path, recursive=recursive, maxdepth=maxdepth)

        def makedirs(self, path, exist_ok=False):
            if not os.path.isdir(self._strip_protocol(path)):
                self._check(path)
            return super().makedirs(path, exist_ok=exist_ok)

    fsspec.register_implementation("faultfs", FaultFS, clobber=True)
    return FaultFS


def _new_faultfs():
    return _faultfs_class()()


_faultfs_class()  # the driver resolves faultfs:// URIs


class SimulatedStorage:
    """``faultfs://`` output under ``root`` (always available)."""

    kind = "simulated"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.out_dir = root / "out"
        self.output = f"faultfs://{self.out_dir}"

    def fail(self, mode: str) -> None:
        (self.root / "fault-mode").write_text(mode)

    def heal(self) -> None:
        (self.root / "fault-mode").write_text("")

    def close(self) -> None:
        pass


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)


class TmpfsStorage:
    """A 4 MiB tmpfs mounted at ``root/mnt``, the output directory inside it."""

    kind = "tmpfs"

    def __init__(self, root: Path) -> None:
        self.mnt = root / "mnt"
        self.mnt.mkdir()
        done = _mount("-t", "tmpfs", "-o", "size=4m", "tmpfs", str(self.mnt))
        if done.returncode != 0:
            raise PermissionError(f"cannot mount a tmpfs: {done.stderr.strip()}")
        self.out_dir = self.mnt / "out"
        self.output = str(self.out_dir)

    def fail(self, mode: str) -> None:
        if mode == "readonly":
            # refused ("busy") while a file on it is open for writing: the job closes its
            # files between writes, so the remount is retried until it lands
            deadline = time.monotonic() + 10
            while (done := _mount("-o", "remount,ro", str(self.mnt))).returncode != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cannot remount read-only: {done.stderr.strip()}")
                time.sleep(0.002)
            return
        chunk = b"\0" * (64 << 10)
        with open(self.mnt / "ballast", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc

    def heal(self) -> None:
        subprocess.run(["mount", "-o", "remount,rw", str(self.mnt)], check=True)
        (self.mnt / "ballast").unlink(missing_ok=True)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True, timeout=30)
