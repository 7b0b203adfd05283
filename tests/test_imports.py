"""`import toolkit` and `import sampler` stay light: no ray, transformers or flashinfer."""

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
