"""derive_seed: stable across processes, machines and Python versions; never Python's hash()."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from sampler import derive_seed


def _documented(base: int, key) -> int:
    """The module docstring's encoding, written out independently."""

    def field(body: bytes) -> bytes:
        return len(body).to_bytes(8, "little") + body

    def enc(v) -> bytes:
        if isinstance(v, int):
            return field(b"i" + str(v).encode())
        if isinstance(v, str):
            return field(b"s" + v.encode("utf-8"))
        if isinstance(v, bytes):
            return field(b"b" + v)
        return field(b"t" + str(len(v)).encode()) + b"".join(enc(x) for x in v)

    digest = hashlib.blake2b(b"raygen.derive_seed\x00" + enc(base) + enc(key),
                             digest_size=16).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


KEYS = [0, 1, -7, 2**80, "row-1", "1", "", "é", b"\x00", (1, 2), ("a", (3, b"z")), [1, 2]]


@pytest.mark.parametrize("key", KEYS)
def test_matches_documented_encoding(key):
    for base in (0, 1, 2**63 - 1, -3):
        got = derive_seed(base, key)
        assert got == _documented(base, key)
        assert 0 <= got < 2**63


def test_distinct_inputs_give_distinct_seeds():
    seeds = {derive_seed(b, k) for b in (0, 1) for k in [0, 1, "0", "1", b"1", (1,), (0, 1)]}
    assert len(seeds) == 14
    assert derive_seed(0, (1, 2)) == derive_seed(0, [1, 2])
    assert derive_seed(np.int64(5), np.int32(3)) == derive_seed(5, 3)


def test_same_in_a_fresh_process_with_another_hash_seed():
    code = "from sampler import derive_seed; print(derive_seed(123, 'row-9'), derive_seed(7, (1, 'x')))"
    env = {**os.environ, "PYTHONHASHSEED": "999"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert [int(v) for v in out] == [derive_seed(123, "row-9"), derive_seed(7, (1, "x"))]


@pytest.mark.parametrize("base,key,name", [(1.5, 1, "base_seed"), (True, 1, "base_seed"),
                                            (0, 1.0, "key"), (0, None, "key"), (0, (1, [None]), "key")])
def test_bad_types_name_the_argument(base, key, name):
    with pytest.raises(ValueError, match=name):
        derive_seed(base, key)
