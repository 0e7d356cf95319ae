"""Plots of the controller harness traces (bench/controllers/run): PNGs next to the CSVs."""
import csv
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return {k: [float(r[k]) for r in rows] for k in rows[0]}


def main(d):
    summary = json.load(open(os.path.join(d, "bench-controllers.json")))

    t = load(os.path.join(d, "bench-controllers-bandwidth.csv"))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(t["step"], [e * 1e3 for e in t["exchange_s"]], label="exchange time (ms)")
    ax.plot(t["step"], [b * 1e3 for b in t["budget_s"]], "k--", label="budget = compute time (ms)")
    ax.axvline(summary["bandwidth_drop_step"], color="r", alpha=0.4, label="link 12 -> 1.2 MB/s")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax2 = ax.twinx()
    ax2.plot(t["step"], t["density"], "g:", label="density sent (1 = dense ring)")
    ax2.set_yscale("log")
    ax2.set_ylabel("density")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    ax.set_title("bandwidth-aware: back within budget %d steps after a 10x drop" % summary["bandwidth_drop_steps_to_budget"])
    fig.tight_layout()
    fig.savefig(os.path.join(d, "bench-controllers-bandwidth.png"), dpi=110)

    a = load(os.path.join(d, "bench-controllers-accuracy.csv"))
    s = load(os.path.join(d, "bench-controllers-accuracy-static.csv"))
    fig, ax = plt.subplots(figsize=(8, 4))
    gap = lambda r: [(l - g) / g * 100 for l, g in zip(r["loss"], r["target"])]
    ax.plot(a["step"], gap(a), label="accuracy controller (from step %d)" % summary["accuracy_push_step"])
    ax.plot(s["step"], gap(s), label="static density 0.0005")
    ax.axhline(2, color="k", ls="--", lw=0.8, label="tolerance 2 %")
    ax.set_xlabel("step")
    ax.set_ylabel("loss gap to dense (%)")
    ax2 = ax.twinx()
    ax2.plot(a["step"], a["density"], "g:", label="density (controller)")
    ax2.set_yscale("log")
    ax2.set_ylabel("density")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    ax.set_title("accuracy-driven: gap %.1f %% -> %.1f %% (static: %.1f %%)" % (
        summary["accuracy_gap_before"] * 100, summary["accuracy_gap_after"] * 100, summary["accuracy_gap_static_end"] * 100))
    fig.tight_layout()
    fig.savefig(os.path.join(d, "bench-controllers-accuracy.png"), dpi=110)

    b = load(os.path.join(d, "bench-controllers-budget.csv"))
    cum, c = [], 0.0
    for v in b["nnz"]:
        c += v
        cum.append(c)
    steps = len(b["step"])
    total = summary["budget_total_elements"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(b["step"], cum, label="cumulative elements sent (hard threshold)")
    ax.plot(b["step"], [total * (i + 1) / steps for i in range(steps)], "k--", label="budget, spread evenly")
    ax.set_xlabel("step")
    ax.set_ylabel("elements per node")
    ax2 = ax.twinx()
    ax2.plot(b["step"], b["threshold"], "g:", label="lambda")
    ax2.set_yscale("log")
    ax2.set_ylabel("lambda")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    ax.set_title("total-error budget: volume within %.2f %% of the budget" % (summary["budget_total_error_fraction"] * 100))
    fig.tight_layout()
    fig.savefig(os.path.join(d, "bench-controllers-budget.png"), dpi=110)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
