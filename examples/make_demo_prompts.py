"""Builds toolkit/data/demo_prompts.parquet: the prompts `raygen demo` runs.

It is also an example of an input dataset: an ``id``, a text ``prompt`` or chat ``messages`` per
row, a ``sampling_params`` struct column whose fields override the job defaults row by row
(null fields keep the default), and a passthrough column (``topic``).

    python examples/make_demo_prompts.py [OUTPUT.parquet]
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TEXT = [
    ("story", "Once upon a time there was a small robot"),
    ("weather", "The weather today is"),
    ("ray", "Ray schedules actors across a cluster; each actor"),
    ("quote", "A journey of a thousand miles"),
    ("numbers", "Numbers: 0 1 2 3 4 5"),
    ("code", "def main():"),
    ("unicode", "Unicode too: café, naïve,"),
    ("lists", "Lists: apples, oranges,"),
]
CHAT = [
    ("chat", "Tell me about Parquet files."),
    ("chat", "What does temperature do when sampling?"),
    ("chat", "Write a short poem about the sea."),
    ("chat", "Which colours do you know?"),
]
PARAMS = [  # one per row, cycled: greedy, seeded samples, logprobs, stop strings, ...
    {"temperature": 0.0},
    {"n": 2, "temperature": 0.8, "seed": 7},
    {"logprobs": 2, "prompt_logprobs": 0},
    {"stop": [".", "\n"], "temperature": 0.7},
    {"top_k": 20, "top_p": 0.9, "seed": 11},
    {"max_tokens": 6, "min_tokens": 3},
    {"repetition_penalty": 1.3, "presence_penalty": 0.5},
    {},
]


def build(path: Path) -> pa.Table:
    rows = []
    for i, (topic, text) in enumerate(TEXT + CHAT):
        chat = i >= len(TEXT)
        rows.append({
            "id": f"demo-{i:02d}",
            "prompt": None if chat else text,
            "messages": [{"role": "user", "content": text}] if chat else None,
            "sampling_params": PARAMS[i % len(PARAMS)],
            "topic": topic,
        })
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, path)
    return table


if __name__ == "__main__":
    default = Path(__file__).resolve().parents[1] / "toolkit" / "data" / "demo_prompts.parquet"
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    target.parent.mkdir(parents=True, exist_ok=True)
    print(build(target).schema)
    print(f"wrote {target}")
