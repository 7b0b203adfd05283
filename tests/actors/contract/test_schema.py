"""The output table builder: the ``top_logprobs`` column equals a per-entry conversion."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa

from actors.contract.schema import TOP_LOGPROB, _top_entries, _top_logprobs_array, build_table
from actors.contract.schema import output_schema

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


def test_engine_top_logprobs_arrays_give_the_same_column_as_their_dicts():
    from actors.engine.generation_output import TopLogprobs

    rng = np.random.default_rng(1)

    def top(steps, k):
        return TopLogprobs(rng.integers(0, 150_000, (steps, k)),
                           rng.standard_normal((steps, k)).astype(np.float32))

    arrays = [top(4, 5), None, top(0, 20), top(128, 20), top(3, 1)]
    as_dicts = [None if v is None else v.to_list() for v in arrays]
    got = _top_logprobs_array(arrays)
    assert got.equals(_reference(as_dicts)) and got.equals(_top_logprobs_array(as_dicts))
    mixed = [arrays[0], as_dicts[3], None]  # arrays and dict lists in one column
    assert _top_logprobs_array(mixed).equals(_reference([as_dicts[0], as_dicts[3], None]))


def test_top_logprobs_reads_as_a_list_of_steps():
    import pickle

    from actors.engine.generation_output import GenerationOutput, TopLogprobs

    ids = np.array([[7, 3], [1, 2], [9, 8]])
    values = np.array([[-0.5, -1.5], [-0.25, -2.0], [-1.0, -1.25]], np.float32)
    top = TopLogprobs(ids, values)
    plain = [[{"token_id": 7, "logprob": -0.5}, {"token_id": 3, "logprob": -1.5}],
             [{"token_id": 1, "logprob": -0.25}, {"token_id": 2, "logprob": -2.0}],
             [{"token_id": 9, "logprob": -1.0}, {"token_id": 8, "logprob": -1.25}]]
    assert len(top) == 3 and top == plain and plain == top and top.to_list() == plain
    assert top[-1] == plain[-1] and top[1:] == plain[1:] and list(top) == plain
    assert top != plain[:2] and top != [[{"token_id": 7, "logprob": -0.5}]] * 3
    assert type(top[0][0]["token_id"]) is int and type(top[0][0]["logprob"]) is float
    assert pickle.loads(pickle.dumps(top)) == top
    out = GenerationOutput(id="a", top_logprobs=top)
    assert out.to_dict()["top_logprobs"] == plain and type(out.to_dict()["top_logprobs"]) is list
    empty = TopLogprobs(np.zeros((0, 4), np.int64), np.zeros((0, 4), np.float32))
    assert len(empty) == 0 and empty == [] and empty.token_ids.shape == (0, 4)


def test_leaf_paths_are_the_column_paths_parquet_writes():
    import pyarrow.parquet as pq

    from actors.contract.schema import leaf_paths

    schema = pa.schema([
        ("a", pa.list_(pa.int32())), ("b", pa.large_list(pa.string())),
        ("c", pa.list_(pa.int8(), 2)), ("d", pa.map_(pa.string(), pa.list_(pa.int64()))),
        ("e", pa.struct([("x", pa.list_(pa.struct([("y", pa.int32()), ("z", pa.string())])))])),
        ("f", pa.dictionary(pa.int32(), pa.string())), ("g.h", pa.int32()),
        *[(f.name, f.type) for f in output_schema()]])
    sink = pa.BufferOutputStream()
    pq.write_table(schema.empty_table(), sink)
    meta = pq.ParquetFile(pa.BufferReader(sink.getvalue())).metadata
    written = [meta.schema.column(i).path for i in range(meta.num_columns)]
    assert [p for f in schema for p in leaf_paths(f.name, f.type)] == written


def test_parts_are_written_plain_where_values_do_not_repeat_and_with_dictionaries_elsewhere():
    import pyarrow.parquet as pq

    from actors.contract.schema import PLAIN_COLUMNS, parquet_options

    outs = [SimpleNamespace(sample_index=0, output_token_ids=[i, i + 1], finish_reason="length",
                            logprobs=[-0.1, -0.2], sampled_ranks=[1, 2], num_output_tokens=2,
                            seed=i, top_logprobs=[[{"token_id": i, "logprob": -0.1}]] * 2)
            for i in range(4)]
    passthrough = pa.table({"group": pa.array(["x", "y", "x", "y"]),
                            "tags": pa.array([{"k": 1}] * 4)})
    schema = output_schema(passthrough=passthrough.schema)
    table = build_table(pa.array(list("abcd")), outs, passthrough, schema)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **parquet_options(schema))
    meta = pq.ParquetFile(pa.BufferReader(sink.getvalue())).metadata
    group = meta.row_group(0)
    encodings = {group.column(i).path_in_schema: group.column(i).encodings
                 for i in range(group.num_columns)}
    dictionary = {path.split(".")[0] for path, enc in encodings.items()
                  if "RLE_DICTIONARY" in enc}
    assert dictionary == {f.name for f in schema} - PLAIN_COLUMNS
    assert pq.read_table(pa.BufferReader(sink.getvalue())).equals(table)
