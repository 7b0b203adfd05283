"""Stable seeds for unseeded requests: ``derive_seed(base_seed, key)``.

The seed of a row that did not set one is derived from the job (or engine) seed and the row
id, so a retried shard, another actor or another machine reproduces the row exactly. The
derivation uses BLAKE2b over a canonical byte encoding of its inputs (never Python's
``hash()``, which is salted per process), so it is the same on every machine and Python
version.

Encoding: ``b"raygen.derive_seed\\x00"``, then the base seed and the key, each as a tagged
field: ints as ``b"i" + decimal digits``, strings as ``b"s" + utf-8``, bytes as ``b"b" + raw``,
tuples/lists as ``b"t" + count`` followed by their items; every field is prefixed with its
length as 8 little-endian bytes. The seed is the first 8 bytes of the 16-byte digest, read
little-endian, with the top bit cleared.
"""

from __future__ import annotations

import hashlib
from typing import Union

SeedKey = Union[int, str, bytes, tuple, list]

_DOMAIN = b"raygen.derive_seed\x00"
SEED_BOUND = 2**63


def _encode(value: object, out: list[bytes], name: str) -> None:
    if isinstance(value, bool):
        raise ValueError(f"{name}: must be an int, str, bytes or a tuple of them, got a bool")
    if isinstance(value, int):
        body = b"i" + str(value).encode("ascii")
    elif isinstance(value, str):
        body = b"s" + value.encode("utf-8")
    elif isinstance(value, (bytes, bytearray)):
        body = b"b" + bytes(value)
    elif isinstance(value, (tuple, list)):
        body = b"t" + str(len(value)).encode("ascii")
        out.append(len(body).to_bytes(8, "little") + body)
        for item in value:
            _encode(item, out, name)
        return
    elif type(value).__module__ == "numpy" and hasattr(value, "item"):
        _encode(value.item(), out, name)
        return
    else:
        raise ValueError(
            f"{name}: must be an int, str, bytes or a tuple of them, got {type(value).__name__}"
        )
    out.append(len(body).to_bytes(8, "little") + body)


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of a request seeded ``seed`` (``n > 1``): sample 0
    keeps ``seed``, sample ``j > 0`` draws with ``derive_seed(seed, ("sample", j))``. Each
    sample's draws depend on its own seed only, so a request of ``n=1`` with that seed
    reproduces the sample alone.

    Example:
        >>> sample_seed(7, 0)
        7
        >>> sample_seed(7, 1) == derive_seed(7, ("sample", 1))
        True
    """
    return seed if sample_index == 0 else derive_seed(seed, ("sample", sample_index))


def derive_seed(base_seed: int, key: SeedKey) -> int:
    """Derives a stable per-row seed from a base seed and a row key.

    Args:
        base_seed: the job (or engine) seed, any Python int (numpy ints accepted).
        key: the row id: an int, a str, bytes, or a tuple/list of those (for example
            ``(row_id, sample_index)``). ``1`` and ``"1"`` are different keys.

    Returns:
        An int in ``[0, 2**63)``, identical in every process, machine and Python version.

    Raises:
        ValueError: ``base_seed`` is not an int, or ``key`` holds an unsupported type.

    Example:
        >>> derive_seed(0, "row-17") == derive_seed(0, "row-17")
        True
        >>> 0 <= derive_seed(1234, 5) < 2**63
        True
    """
    if type(base_seed).__module__ == "numpy" and hasattr(base_seed, "item"):
        base_seed = base_seed.item()
    if isinstance(base_seed, bool) or not isinstance(base_seed, int):
        raise ValueError(f"base_seed: must be an int, got {base_seed!r}")
    parts: list[bytes] = [_DOMAIN]
    _encode(base_seed, parts, "base_seed")
    _encode(key, parts, "key")
    digest = hashlib.blake2b(b"".join(parts), digest_size=16).digest()
    return int.from_bytes(digest[:8], "little") & (SEED_BOUND - 1)
