"""Plots the GPU device time per sampler step from a sampler_bench JSON (needs matplotlib).

    python benchmarks/plot_sampler_bench.py docs/records/sampler_bench_h200.json docs/records/sampler_bench_h200.png
"""

from __future__ import annotations

import json
import sys


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(src))
    recs = [r for r in data["records"] if "gpu_ms" in r and r.get("source", "grid") == "grid"]
    seen = {(r["workload"], r["batch"], r["vocab"], r["backend"]) for r in recs}
    recs += [r for r in data["records"] if "gpu_ms" in r and r.get("source") == "b256_run"
             and (r["workload"], r["batch"], r["vocab"], r["backend"]) not in seen]
    vocab = max(r["vocab"] for r in recs)
    workloads = sorted({r["workload"] for r in recs if r["vocab"] == vocab})
    fig, axes = plt.subplots(1, len(workloads), figsize=(3.2 * len(workloads), 3.2), sharey=True)
    for ax, w in zip(axes, workloads):
        for backend, style in (("torch", "o-"), ("triton", "s-"), ("flashinfer", "^-"),
                               ("flashinfer_alone", "x--")):
            pts = sorted((r["batch"], r["gpu_ms"] * 1e3) for r in recs
                         if r["workload"] == w and r["backend"] == backend and r["vocab"] == vocab)
            if pts:
                ax.plot(*zip(*pts), style, label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(w, fontsize=9)
        ax.set_xlabel("batch")
    axes[0].set_ylabel(f"GPU µs per step (vocab {vocab})")
    fullest = max(axes, key=lambda a: len(a.get_lines()))
    fullest.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
