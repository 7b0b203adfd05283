"""Summarises ``RAYGEN_TRACE_DIR`` timelines (``actors.engine.profiling.Trace``): per batch of each
process, its decode steps (host, CPU and device-wait milliseconds a step), its prefill steps
(host seconds in all), how many decode steps ran beside a shard thread's Python work (reading
the next shard, building requests, writing a part) and the collector's time; then, per
process, its steps from its first batch's start to its last batch's end taken once each
(batches that share the engine overlap): decode and prefill steps, their host and CPU
seconds, the host time the stepping thread was runnable but not running (host less CPU:
another thread held the GIL), and the shard threads' work in that window.

    RAYGEN_TRACE_DIR=$OUT/trace python3 benchmarks/job_bench.py --max-actors 1 ...
    python3 benchmarks/trace_summary.py $OUT/trace          # a table; --json for the records
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

SHARD_WORK = ("prepare", "build", "write")


def _shard_work(events: list) -> list:
    """The shard threads' Python work (the first shard's prefetch, during startup, aside)."""
    return [e for e in events if e[0] in SHARD_WORK and e[1] != "shard-prefetch"]


def _split(steps: list, start: float, end: float, max_decode_tokens: int) -> tuple[list, list]:
    """The steps that ended within ``[start, end]`` and computed tokens: (decode, prefill)."""
    inside = [s for s in steps if start <= s[0] <= end + 1e-3 and s[4] > 0]
    return ([s for s in inside if s[4] <= max_decode_tokens],
            [s for s in inside if s[4] > max_decode_tokens])


def _beside(steps: list, work: list) -> list:
    """The steps (end, seconds, ...) that overlapped a span of ``work``."""
    return [s for s in steps if any(w[2] < s[0] and w[3] > s[0] - s[1] for w in work)]


def summarise(trace: dict, max_decode_tokens: int) -> list[dict]:
    """One record per batch of ``trace`` (a loaded trace file). A step computing at most
    ``max_decode_tokens`` tokens counts as a decode step (the engine's max_num_seqs)."""
    steps, events = trace["steps"], trace["events"]
    work = _shard_work(events)
    out = []
    for batch in (e for e in events if e[0] == "batch"):
        start, end = batch[2], batch[3]
        decode, prefill = _split(steps, start, end, max_decode_tokens)
        beside = _beside(decode, work)
        collections = [e for e in events if e[0] == "gc" and start <= e[2] <= end]

        def mean_ms(values: list[float]) -> float:
            return round(statistics.mean(values) * 1e3, 2) if values else 0.0

        out.append({
            "seconds": round(end - start, 3), "rows": batch[4],
            "decode_steps": len(decode),
            "decode_host_ms": mean_ms([s[1] - s[2] for s in decode]),
            "decode_cpu_ms": mean_ms([s[3] for s in decode]),
            "decode_wait_ms": mean_ms([s[2] for s in decode]),
            "prefill_steps": len(prefill),
            "prefill_host_s": round(sum(s[1] - s[2] for s in prefill), 3),
            "decode_steps_beside_shard_work": len(beside),
            "gc_ms": round(sum(e[3] - e[2] for e in collections) * 1e3, 1),
        })
    return out


def summarise_process(trace: dict, max_decode_tokens: int) -> dict:
    """The steps of ``trace`` within its batches' span, each counted once."""
    steps, events = trace["steps"], trace["events"]
    batches = [e for e in events if e[0] == "batch"]
    if not batches:
        return {}
    start, end = min(b[2] for b in batches), max(b[3] for b in batches)
    work = [w for w in _shard_work(events) if w[3] > start and w[2] < end]
    out: dict = {"seconds": round(end - start, 3),
                 "shard_work_s": round(sum(w[3] - w[2] for w in work), 3)}
    for kind, chosen in zip(("decode", "prefill"),
                            _split(steps, start, end, max_decode_tokens)):
        host = sum(s[1] - s[2] for s in chosen)
        cpu = sum(s[3] for s in chosen)
        out[kind] = {"steps": len(chosen), "tokens": sum(s[4] for s in chosen),
                     "busy_s": round(sum(s[1] for s in chosen), 3), "host_s": round(host, 3),
                     "cpu_s": round(cpu, 3), "not_running_s": round(host - cpu, 3),
                     "beside_shard_work": len(_beside(chosen, work))}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory")
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    args = p.parse_args(argv)
    records, processes = {}, {}
    for path in sorted(Path(args.directory).glob("trace-*.json")):
        trace = json.loads(path.read_text())
        records[path.name] = summarise(trace, args.max_num_seqs)
        processes[path.name] = summarise_process(trace, args.max_num_seqs)
    report = {"batches": records, "processes": processes}
    if args.json:
        print(json.dumps(report, indent=1))
        return report
    print(f"{'file':18} {'batch s':>7} {'rows':>5} {'decode':>6} {'host ms':>7} {'cpu ms':>6} "
          f"{'wait ms':>7} {'prefill':>7} {'host s':>6} {'beside':>6} {'gc ms':>6}")
    for name, batches in records.items():
        for b in batches:
            print(f"{name:18} {b['seconds']:7.3f} {b['rows']:5d} {b['decode_steps']:6d} "
                  f"{b['decode_host_ms']:7.2f} {b['decode_cpu_ms']:6.2f} {b['decode_wait_ms']:7.2f} "
                  f"{b['prefill_steps']:7d} {b['prefill_host_s']:6.3f} "
                  f"{b['decode_steps_beside_shard_work']:6d} {b['gc_ms']:6.1f}")
    print(f"\n{'file':18} {'window s':>8} {'steps':>13} {'busy s':>6} {'host s':>6} "
          f"{'cpu s':>6} {'not running s':>13} {'beside shard work':>17} {'shard work s':>12}")
    for name, proc in processes.items():
        for kind in ("decode", "prefill") if proc else ():
            k = proc[kind]
            print(f"{name:18} {proc['seconds']:8.3f} {k['steps']:5d} {kind:7} {k['busy_s']:6.3f} "
                  f"{k['host_s']:6.3f} {k['cpu_s']:6.3f} {k['not_running_s']:13.3f} "
                  f"{k['beside_shard_work']:17d} {proc['shard_work_s']:12.3f}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
