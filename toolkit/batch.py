"""``raygen run-batch``: an OpenAI Batch input file in, the OpenAI Batch output file out.

The input's lines run as a job (``input_format: openai_batch``, see ``actors.contract.openai_batch``):
sharded, on as many actors as asked, committed and resumable like any job, into a work
directory beside the output (``<output>.raygen/``; a rerun after an interruption resumes
there, and it is removed once the output is written). Then every line gets one output line,
in input order::

    {"id": "batch_req_<line>", "custom_id": ..., "error": null,
     "response": {"status_code": 200, "request_id": "req_<line>", "body": <chat.completion or
                  text_completion object, with usage>}}

A line that could not run (malformed, an unknown field, a bad value, a failed generation) gets
``status_code`` 400 and ``body: {"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from actors.contract.openai_batch import CHAT

_FINISH = {"stop": "stop", "length": "length", "abort": "length"}


@dataclass(slots=True)
class BatchResult:
    """What ``run_batch`` reports."""

    output: str
    lines: int
    errors: int
    job: Any  # the JobResult of the batch's job

    def summary(self) -> str:
        return "\n".join([f"output:  {self.output}",
                          f"lines:   {self.lines} ({self.errors} errors)",
                          *self.job.summary().splitlines()[2:]])


def work_dir(output: str | os.PathLike) -> Path:
    """The job directory of a batch whose output file is ``output``."""
    path = Path(output)
    return path.with_name(path.name + ".raygen")


def batch_config(input_path: str, output: str, model: str, *, num_actors: int = 1,
                 num_gpus_per_actor: float | None = None,
                 overrides: list[str] | None = None) -> dict[str, Any]:
    """The job config of a batch (``overrides``: ``key=value`` as for ``raygen run --set``)."""
    from jobs.config import apply_overrides

    if num_gpus_per_actor is None:
        num_gpus_per_actor = 1 if os.path.exists("/dev/nvidia0") else 0
    config = {"model": model, "input": input_path, "output": str(work_dir(output)),
              "input_format": "openai_batch", "num_actors": num_actors,
              "num_gpus_per_actor": num_gpus_per_actor}
    return apply_overrides(config, list(overrides or []))


def run_batch(input_path: str, output: str, model: str, *, num_actors: int = 1,
              num_gpus_per_actor: float | None = None, overrides: list[str] | None = None,
              progress: bool = True) -> BatchResult:
    """Runs an OpenAI Batch file and writes its output file (see the module docstring).

    Example:
        >>> run_batch("in.jsonl", "out.jsonl", "Qwen/Qwen2.5-0.5B-Instruct")  # doctest: +SKIP
    """
    from jobs.runner import run_job

    config = batch_config(input_path, output, model, num_actors=num_actors,
                          num_gpus_per_actor=num_gpus_per_actor, overrides=overrides)
    job = run_job(config, progress=progress)
    lines, errors = write_batch_output(config["output"], output, model)
    shutil.rmtree(config["output"])
    return BatchResult(output=str(output), lines=lines, errors=errors, job=job)


def _rows(job_output: str) -> Iterator[list[dict[str, Any]]]:
    """The job's output rows grouped by input line (all samples of a line), in line order."""
    import pyarrow.parquet as pq

    parts = sorted(Path(job_output).glob("part-*.parquet"))
    group: list[dict[str, Any]] = []
    for part in parts:
        table = pq.read_table(part)
        rows = sorted(table.to_pylist(), key=lambda r: (int(r["id"]), r["sample_index"]))
        for row in rows:
            if group and group[0]["id"] != row["id"]:
                yield group
                group = []
            group.append(row)
    if group:
        yield group


def _token(tokenizer: Any, token_id: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([token_id])
    return text, list(text.encode("utf-8", "replace"))


def _chat_logprobs(row: dict[str, Any], tokenizer: Any) -> dict[str, Any] | None:
    if row["logprobs"] is None:
        return None
    tops = row["top_logprobs"] or [[] for _ in row["logprobs"]]
    content = []
    for token_id, value, top in zip(row["output_token_ids"], row["logprobs"], tops):
        text, raw = _token(tokenizer, token_id)
        alternatives = []
        for entry in top:
            alt, alt_raw = _token(tokenizer, entry["token_id"])
            alternatives.append({"token": alt, "logprob": entry["logprob"], "bytes": alt_raw})
        content.append({"token": text, "logprob": value, "bytes": raw,
                        "top_logprobs": alternatives})
    return {"content": content}


def _completion_logprobs(row: dict[str, Any], tokenizer: Any) -> dict[str, Any] | None:
    if row["logprobs"] is None:
        return None
    tops = row["top_logprobs"] or [None for _ in row["logprobs"]]
    tokens, offsets, offset = [], [], 0
    top_maps = []
    for token_id, top in zip(row["output_token_ids"], tops):
        text = tokenizer.decode([token_id])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top_maps.append(None if top is None else
                        {tokenizer.decode([e["token_id"]]): e["logprob"] for e in top})
    return {"tokens": tokens, "token_logprobs": list(row["logprobs"]),
            "top_logprobs": top_maps, "text_offset": offsets}


def response_line(group: list[dict[str, Any]], model: str, tokenizer: Any,
                  created: int) -> dict[str, Any]:
    """The output line of one input line (its rows: one per sample)."""
    first = group[0]
    line = int(first["id"])
    out = {"id": f"batch_req_{line}", "custom_id": first["custom_id"], "error": None}
    request_id = f"req_{line}"
    failed = next((r["error"] for r in group if r["error"] is not None), None)
    if failed is not None:
        message = failed.split("): ", 1)[-1]  # without the "row id .. (shard ..)" prefix
        out["response"] = {"status_code": 400, "request_id": request_id, "body": {"error": {
            "message": message, "type": "invalid_request_error", "param": None, "code": None}}}
        return out
    chat = first["endpoint"] == CHAT
    choices = []
    for row in group:
        choice: dict[str, Any] = {"index": row["sample_index"],
                                  "finish_reason": _FINISH.get(row["finish_reason"], "stop")}
        if chat:
            choice["message"] = {"role": "assistant", "content": row["output_text"]}
            choice["logprobs"] = _chat_logprobs(row, tokenizer)
        else:
            choice["text"] = row["output_text"]
            choice["logprobs"] = _completion_logprobs(row, tokenizer)
        choices.append(choice)
    completion = sum(int(r["num_output_tokens"]) for r in group)
    prompt = int(first["num_prompt_tokens"])
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}}
    out["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    return out


def write_batch_output(job_output: str, output: str | os.PathLike, model: str,
                       *, trust_remote_code: bool = False) -> tuple[int, int]:
    """Writes the OpenAI Batch output file of a finished ``openai_batch`` job (to a temporary
    file renamed into place). Returns (lines, error lines)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    target = Path(output)
    temp = target.with_name(f".{target.name}.tmp")
    created = int(time.time())
    lines = errors = 0
    with open(temp, "w", encoding="utf-8") as f:
        for group in _rows(job_output):
            line = response_line(group, model, tokenizer, created)
            errors += line["response"]["status_code"] != 200
            lines += 1
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    os.replace(temp, target)
    return lines, errors
