"""Security (issue 8): configs are read with ``yaml.safe_load`` only; a checkpoint's own code
never runs unless ``trust_remote_code`` is set. (YAML object tags refused:
``tests/jobs/test_config.py::test_yaml_round_trip_and_safe_load``; submission with and without
the cluster's auth token: ``tests/toolkit/test_submit.py``.)
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import jobs.runner
from jobs.config import JobConfig
from jobs.runner import engine_options, run_job
from tests.jobs.helpers import write_parquet

ROOT = Path(__file__).resolve().parents[2]
UNSAFE_YAML = re.compile(r"yaml\.(load|unsafe_load|full_load|load_all|unsafe_load_all)\(|"
                         r"Loader\s*=|yaml\.Loader|yaml\.UnsafeLoader|yaml\.FullLoader")


def test_product_code_reads_yaml_only_with_safe_load():
    sources = [p for pkg in ("toolkit", "jobs", "actors", "sampler")
               for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(sources) > 20
    unsafe = [f"{p.relative_to(ROOT)}:{n}" for p in sources
              for n, line in enumerate(p.read_text().splitlines(), 1) if UNSAFE_YAML.search(line)]
    assert unsafe == []
    loaders = [p for p in sources if "safe_load(" in p.read_text()]
    assert ROOT / "jobs" / "config.py" in loaders


def test_trust_remote_code_is_off_unless_set():
    base = {"model": "m", "input": "i", "output": "o", "num_gpus_per_actor": 0}
    assert JobConfig.from_dict(base).trust_remote_code is False
    assert engine_options(JobConfig.from_dict(base))["trust_remote_code"] is False
    on = JobConfig.from_dict({**base, "trust_remote_code": True})
    assert engine_options(on)["trust_remote_code"] is True
    assert "trust_remote_code" in on.output_identity()  # a rerun cannot switch it silently


@pytest.mark.ray
def test_checkpoint_code_does_not_run_without_trust_remote_code(ray_local, tiny_llama,
                                                                tmp_path, monkeypatch):
    """A checkpoint whose config maps to its own Python code (which would leave a marker
    file when imported): the job fails before Ray with a message about trust_remote_code;
    past that check (as if the driver had missed it) the actor refuses to load it too; the
    code never ran, neither on the driver nor in an actor."""
    model = tmp_path / "remote-code-model"
    shutil.copytree(tiny_llama, model)
    marker = tmp_path / "code-ran"
    (model / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'raygen_evil'\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n")
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="raygen_evil", architectures=["EvilModel"],
                  auto_map={"AutoConfig": "evil.EvilConfig",
                            "AutoModelForCausalLM": "evil.EvilModel"})
    (model / "config.json").write_text(json.dumps(config))
    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "hello"}])
    job = {"model": str(model), "input": str(tmp_path / "in.parquet"),
           "output": str(tmp_path / "out"), "num_gpus_per_actor": 0,
           "engine": {"max_num_seqs": 4, "max_model_len": 32, "num_kv_blocks": 16}}
    with pytest.raises(ValueError, match=r"config.model: .* needs its own Python code .*"
                                         r"runs only with trust_remote_code: true"):
        run_job(job, progress=False)
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(jobs.runner, "_refuse_remote_code", lambda model, data: None)
    with pytest.raises(RuntimeError, match=r"actor-0 failed to start: .*trust_remote_code"):
        run_job(job, progress=False)
    assert not marker.exists()
