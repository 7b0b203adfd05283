"""Filesystems for inputs and outputs: local paths, pyarrow URIs, fsspec URIs, globs.

Everything downstream works on a ``(pyarrow.fs.FileSystem, path)`` pair; both pickle, so a
shard task carries them to the actor that reads and writes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable

import pyarrow.fs as pafs

_PYARROW_SCHEMES = frozenset({"file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss"})
_URI = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True, slots=True)
class Location:
    """A path on a filesystem, with the spelling the user gave (for messages)."""

    fs: pafs.FileSystem
    path: str
    spelled: str

    def join(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"


def resolve(uri_or_path: str) -> Location:
    """Maps a local path or a URI to a filesystem and a path on it.

    Raises:
        ValueError: the URI scheme is unknown to both pyarrow and fsspec.
    """
    match = _URI.match(uri_or_path)
    if match is None:
        path = os.path.abspath(os.path.expanduser(uri_or_path))
        return Location(pafs.LocalFileSystem(), path, uri_or_path)
    scheme = match.group(1).lower()
    if scheme in _PYARROW_SCHEMES:
        try:
            fs, path = pafs.FileSystem.from_uri(_strip_glob(uri_or_path))
        except (ValueError, OSError) as exc:
            raise ValueError(f"cannot open {uri_or_path!r}: {exc}") from None
        tail = uri_or_path[len(_strip_glob(uri_or_path)):]
        return Location(fs, path + tail, uri_or_path)
    try:
        import fsspec
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        fs, path = fsspec.core.url_to_fs(uri_or_path)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"cannot open {uri_or_path!r}: unknown URI scheme {scheme!r} ({exc})") \
            from None
    return Location(PyFileSystem(FSSpecHandler(fs)), path, uri_or_path)


def _strip_glob(uri: str) -> str:
    """The URI up to the first path component with a glob character."""
    match = _GLOB_CHARS.search(uri)
    if match is None:
        return uri
    return uri[: uri.rfind("/", 0, match.start())]


def has_glob(path: str) -> bool:
    return _GLOB_CHARS.search(path) is not None


def _glob_regex(pattern: str) -> re.Pattern:
    """``*`` and ``?`` stay within a path component; ``**/`` spans any number of them."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out.append(re.escape("["))
                i += 1
            else:
                body = pattern[i + 1:end]
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def _is_hidden(relative: str) -> bool:
    return any(part.startswith((".", "_")) for part in relative.split("/") if part)


def list_files(loc: Location) -> list[str]:
    """Files named by ``loc``: the file itself, a directory's visible files (recursively; names
    starting with ``.`` or ``_`` skipped), or a glob's matches. Sorted."""
    if has_glob(loc.path):
        match = _GLOB_CHARS.search(loc.path)
        base = loc.path[: loc.path.rfind("/", 0, match.start())] or "/"
        regex = _glob_regex(loc.path)
        infos = _select(loc, base)
        return sorted(i.path for i in infos
                      if i.type == pafs.FileType.File and regex.match(i.path)
                      and not _is_hidden(i.path[len(base):]))
    info = loc.fs.get_file_info(loc.path)
    if info.type == pafs.FileType.File:
        return [loc.path]
    if info.type == pafs.FileType.Directory:
        infos = _select(loc, loc.path)
        return sorted(i.path for i in infos
                      if i.type == pafs.FileType.File and not _is_hidden(i.path[len(loc.path):]))
    raise ValueError(f"input: {loc.spelled!r} does not exist")


def _select(loc: Location, base: str) -> list[pafs.FileInfo]:
    try:
        return loc.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    except OSError as exc:
        raise ValueError(f"input: cannot list {loc.spelled!r}: {exc}") from None


def write_atomic(fs: pafs.FileSystem, path: str, data: bytes,
                 before_rename: Callable[[], None] | None = None) -> None:
    """Writes ``data`` to a hidden temporary file beside ``path`` and renames it into place
    (``before_rename`` runs in between: a fault-injection point for tests)."""
    head, _, name = path.rpartition("/")
    tmp = f"{head}/.{name}.tmp"
    with fs.open_output_stream(tmp) as stream:
        stream.write(data)
    if before_rename is not None:
        before_rename()
    fs.move(tmp, path)


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes | None:
    """The file's content, or None when it does not exist."""
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(path) as stream:
        return stream.read()
