"""Where an engine step's host time goes, prefill steps included (GPU only).

Builds the Qwen2-0.5B-shaped model (random weights), runs 1,024 prompts of 128 tokens with
job_bench's per-row params mix through an engine configured as job_bench's actors (1,024
rows, 32,768-token steps), warmed up, with ``actors.engine.step_timer.StepTimer`` attached, and
prints, for the first steps of the timed run: tokens and rows, the host's milliseconds in
input preparation, the forward's launch and the sampler's launch, the step's host total and
its wait for sampled tokens, and the GPU's milliseconds for the forward and the sampler. Then
runs three prefill steps under ``torch.cuda.set_sync_debug_mode("warn")`` and prints the
synchronising operations it reports (none is a good answer; the mode does not see every kind).

    source .carry/activate.sh; export PYTHONPATH=$PWD:$PYTHONPATH
    python3 benchmarks/step_phases.py
"""
import sys, warnings, collections
sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from pathlib import Path
import numpy as np, torch
import job_bench as jb
import job_rows
e2e = jb.load_e2e()
path = Path("/tmp/diag_model")
if not (path / "config.json").exists():
    e2e.build_model(e2e.QWEN2_05B, path)
from actors.engine.llm_engine import Engine
from actors.engine.step_timer import StepTimer
from sampler import SamplingParams
engine = Engine(str(path), {"max_num_seqs": 1024, "max_num_batched_tokens": 32768, "max_model_len": 256,
                            "enable_prefix_caching": False, "block_size": 16, "num_kv_blocks": 1024 * 16 + 64})
engine.warm_up(); torch.cuda.synchronize()
rng = np.random.default_rng(0)
def reqs(tag, mt):
    out = []
    for i in range(1024):
        p = job_rows.row_params(i); p.update(max_tokens=mt, ignore_eos=True, detokenize=False)
        out.append((f"{tag}{i}", rng.integers(100, 151000, 128).tolist(), SamplingParams(**p)))
    return out
engine.generate(reqs("w", 4)); torch.cuda.synchronize()
timer = StepTimer().attach(engine)
engine.generate(reqs("a", 8)); torch.cuda.synchronize()
timer.detach()
print("step tokens seqs | host: prepare forward sampler total wait | gpu: fwd sampler")
for s in timer.steps[:12]:
    m = s.host_marks
    g = lambda a, b: s.events[a].elapsed_time(s.events[b]) if a in s.events and b in s.events else float("nan")
    print(f"{s.num_tokens:6d} {s.num_seqs:5d} | {(m['gpu_start']-s.host_start)*1e3:6.1f} {(m.get('sample', m['end'])-m['gpu_start'])*1e3:6.1f} "
          f"{(m['end']-m.get('sample', m['end']))*1e3:6.1f} {(s.host_end-s.host_start)*1e3:6.1f} {s.wait_s*1e3:6.1f} | {g('gpu_start','sample'):6.1f} {g('sample','end'):6.1f}")
# hidden synchronisations in a prefill step
torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    engine.add_requests(reqs("b", 2))
    for _ in range(3):
        engine.step()
torch.cuda.set_sync_debug_mode(0)
count = collections.Counter((str(w.filename).split("/")[-1], w.lineno, str(w.message)[:90]) for w in caught)
for k, v in count.most_common(20): print(v, k)
while engine.has_unfinished_requests(): engine.step()
