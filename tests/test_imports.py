"""`import toolkit` and `import sampler` stay light: no ray, transformers or flashinfer; a job's
driver and the unpickling of an actor's task load no torch either."""

import json
import subprocess
import sys

import pytest

HEAVY = ("ray", "transformers", "flashinfer", "triton")


@pytest.mark.parametrize("module", ["toolkit", "sampler"])
def test_import_loads_no_heavy_module(module):
    code = (
        f"import json, sys; import {module}; "
        "print(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert module in loaded
    assert not loaded & set(HEAVY), f"import {module} loaded {sorted(loaded & set(HEAVY))}"


@pytest.mark.parametrize("statement", [
    "import sampler.params",  # SamplingParams: what the driver validates params with
    "import jobs.runner, jobs.dispatch, jobs.plan, jobs.config",  # the driver of `raygen run`
    "import actors.actor, actors.contract.task",  # what a Ray worker imports before the constructor
    # the driver checks the engine options it ships (device "auto" is resolved on the actor)
    "from jobs.config import JobConfig; from jobs.runner import engine_options; "
    "engine_options(JobConfig(model='m', input='i.parquet', output='o', "
    "engine={'max_num_seqs': 8}))",
])
def test_the_driver_side_loads_no_torch(statement):
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = {m.split(".")[0] for m in json.loads(out.stdout.strip().splitlines()[-1])}
    assert not loaded & {"torch", "transformers", "triton", "flashinfer"}, statement


def test_the_sampler_names_import_on_first_use():
    import importlib

    import sampler

    assert set(sampler.__all__) <= set(dir(sampler))
    for name in sampler.__all__:  # each name is the object its submodule defines
        home = importlib.import_module(sampler._EXPORTS[name])
        assert getattr(sampler, name) is getattr(home, name), name
    from sampler import Sampler, SamplingParams
    from sampler.params import SamplingParams as defined
    from sampler.sampler import Sampler as stateful

    assert Sampler is stateful and SamplingParams is defined
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        sampler.Nope  # noqa: B018


def test_triton_is_an_extra_and_a_cpu_run_needs_none(tiny_llama):
    """A CPU ``pip install -e .`` pulls no Triton (``gpu`` and ``dev`` extras do), and
    generating on the CPU works in a process where Triton cannot be imported."""
    import os
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("triton")]
    for extra in ("gpu", "dev"):
        assert [d for d in project["optional-dependencies"][extra] if d.startswith("triton")]
    code = ("import sys; sys.modules['triton'] = None\n"  # import triton -> ImportError
            "from toolkit import SamplingParams, generate\n"
            "outs = generate(['hello'], SamplingParams(max_tokens=3, seed=1),"
            f" model={tiny_llama!r}, device='cpu', max_model_len=64)\n"
            "assert 'triton' not in [m.split('.')[0] for m in sys.modules if sys.modules[m]]\n"
            "print(len(outs[0].output_token_ids))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "3"
