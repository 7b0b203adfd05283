"""The public facade: every exported name resolves to the implementation it stands for."""

from __future__ import annotations

import pytest

import toolkit


def test_exports_resolve():
    from actors.engine.generation_output import GenerationOutput
    from jobs.config import JobConfig
    from jobs.progress import JobResult
    from jobs.runner import run_job
    from sampler.params import SamplingParams
    from toolkit.submit import job_status, submit_job

    assert toolkit.JobConfig is JobConfig and toolkit.run_job is run_job
    assert toolkit.JobResult is JobResult and toolkit.SamplingParams is SamplingParams
    assert toolkit.submit_job is submit_job and toolkit.job_status is job_status
    assert toolkit.GenerationOutput is GenerationOutput and callable(toolkit.generate)
    assert set(toolkit.__all__) <= set(dir(toolkit))


def test_unknown_name():
    with pytest.raises(AttributeError, match="no attribute 'run_jobs'"):
        toolkit.run_jobs  # noqa: B018


def test_job_result_summary():
    res = toolkit.JobResult(output="out", rows=10, input_rows=8, errors=1, tokens=40,
                            prompt_tokens=30, seconds=2.0, tokens_per_second=20.0, shards=2,
                            shards_skipped=1, actor_share={"actor-0": 0.75, "actor-1": 0.25})
    text = res.summary()
    assert "10 output rows for 8 input rows, 1 errors" in text
    assert "20.0 output tokens/s" in text and "actor-0 75%, actor-1 25%" in text
