"""What PyTorch takes on this GPU for the work sparsecar's CUDA selections do, measured with CUDA
events (median of --reps runs after warm-up) on the same sizes as sparsecar_cuda_bench:

  torch.topk of |r| (k = density n), torch.nonzero(|r| >= lambda) + gather, the fused-EF
  equivalents in torch ops (r += g; mask = |r| >= lambda; indices = nonzero; values = r[mask];
  r[mask] = 0; and the same with topk), and a device copy of one buffer.

Usage: python3 torch_gpu_baseline.py [--n N] [--density D] [--reps R] [--json FILE]
--json FILE appends one JSON object a line per row, as sparsecar_cuda_bench does: {"kernel",
"elements", "density", "ms", "gbps", "ratio_to_copy", "card"}; gbps counts the least bytes the
operation must move (as the sparsecar rows count them), ratio_to_copy is against torch's own
device copy in this run.
"""
import argparse
import json
import math

import torch


def median_ms(fn, reset, reps):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        reset()
        fn()
    times = []
    for _ in range(reps):
        reset()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1 << 26)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.n <= 0 or not 0 < a.density <= 1 or a.reps < 1:
        ap.error("need n > 0, 0 < density <= 1, reps >= 1")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    pristine = torch.randn(a.n, device=dev, generator=g)
    grad = torch.randn(a.n, device=dev, generator=g) * 0.1
    r = pristine.clone()
    k = max(1, round(a.density * a.n))
    lo, hi = 0.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if math.erfc(mid / (1.005 * math.sqrt(2.0))) > a.density:
            lo = mid
        else:
            hi = mid
    lam = lo

    def reset():
        r.copy_(pristine)

    def ef_threshold():
        r.add_(grad)
        mask = r.abs() >= lam
        idx = mask.nonzero().squeeze(1)
        vals = r[idx]
        r[idx] = 0
        return idx, vals

    def ef_topk():
        r.add_(grad)
        vals, idx = torch.topk(r.abs(), k, sorted=False)
        sent = r[idx]
        r[idx] = 0
        return idx, sent

    def nonzero_gather():
        idx = (r.abs() >= lam).nonzero().squeeze(1)
        return idx, r[idx]

    n, pairs = float(a.n), 8.0 * k
    # (name, ms, least bytes moved)
    rows = [
        ("device copy (torch)", median_ms(lambda: r.copy_(pristine), lambda: None, a.reps), 8 * n),
        ("torch EF + threshold (add, abs, >=, nonzero, gather, zero)", median_ms(ef_threshold, reset, a.reps),
         12 * n + pairs),
        ("torch.nonzero(|r| >= t) + gather", median_ms(nonzero_gather, reset, a.reps), 4 * n + pairs),
        ("torch.topk(|r|, k) alone", median_ms(lambda: torch.topk(r.abs(), k, sorted=False), reset, a.reps),
         4 * n + pairs),
        ("torch EF + topk (add, abs, topk, gather, zero)", median_ms(ef_topk, reset, a.reps), 12 * n + pairs),
    ]
    card = torch.cuda.get_device_name(0)
    print(f"GPU: {card}, torch {torch.__version__}")
    print(f"n = {a.n}, density {a.density} (k = {k}), {a.reps} reps, median")
    print("| torch baseline | ms |")
    print("| --- | --- |")
    for name, ms, _ in rows:
        print(f"| {name} | {ms:.3f} |")
    if a.json:
        copy_gbps = rows[0][2] / (rows[0][1] * 1e6)
        with open(a.json, "a", encoding="utf-8") as f:
            for name, ms, floor in rows:
                gbps = floor / (ms * 1e6)
                f.write(json.dumps({"kernel": name, "elements": a.n, "density": a.density, "ms": round(ms, 5),
                                    "gbps": round(gbps, 1), "ratio_to_copy": round(gbps / copy_gbps, 4),
                                    "card": f"{card}, torch {torch.__version__}", "source": "torch"}) + "\n")


if __name__ == "__main__":
    main()
