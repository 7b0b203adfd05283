"""The output table builder: the ``top_logprobs`` column equals a per-entry conversion."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa

from actors.schema import TOP_LOGPROB, _top_entries, _top_logprobs_array, build_table
from actors.schema import output_schema

TYPE = pa.list_(pa.list_(TOP_LOGPROB))


def _reference(values):
    return pa.array([None if v is None else [_top_entries(s) for s in v] for v in values],
                    type=TYPE)


def test_top_logprobs_column_equals_the_per_entry_conversion():
    rng = np.random.default_rng(0)

    def dicts(k):
        return [{"token_id": int(i), "logprob": float(v)}
                for i, v in zip(rng.integers(0, 1000, k), rng.standard_normal(k))]

    values = [
        None,
        [dicts(3), dicts(3)],
        [],  # no steps
        [[], dicts(2)],  # a step with no entries
        [{5: -0.5, 7: -1.5}],  # a mapping per step
        [[(3, -0.1), (4, -0.2)]],  # (id, value) pairs
        [(SimpleNamespace(token_id=9, logprob=-2.0),)],  # objects, in a tuple
        [dicts(20) for _ in range(50)],
        None,
    ]
    got = _top_logprobs_array(values)
    assert got.type == TYPE
    assert got.equals(_reference(values))
    assert _top_logprobs_array([None, None]).equals(_reference([None, None]))
    assert _top_logprobs_array([]).equals(_reference([]))


def test_build_table_keeps_the_schema_with_top_logprobs():
    out = SimpleNamespace(sample_index=0, output_token_ids=[1, 2], finish_reason="length",
                          logprobs=[-0.1, -0.2], sampled_ranks=[1, 2], num_output_tokens=2,
                          top_logprobs=[[{"token_id": 1, "logprob": -0.1}],
                                        [{"token_id": 2, "logprob": -0.2}]])
    schema = output_schema()
    table = build_table(pa.array(["a"]), [out], None, schema)
    assert table.schema == schema
    assert table.column("top_logprobs").to_pylist() == [
        [[{"token_id": 1, "logprob": -0.10000000149011612}],
         [{"token_id": 2, "logprob": -0.20000000298023224}]]]
