#!/usr/bin/python3
"""The hard-threshold paper's logistic-regression experiment (Sahu et al., NeurIPS 2021, Fig. 1)
on sparsecar's own kernels, with the workers simulated in one process.

Problem: L2-regularised logistic regression on a seeded synthetic gisette-shaped dataset
(6,000 samples x 5,000 features in [0, 1], ~13 % non-zero, a few informative features and the
rest probes, labels from a hidden logistic model); 20 workers, each holding 1/20 of the samples,
batch 1 per worker, 10 epochs, constant step gamma = 1.19e-3.

Methods, every one with error feedback in gradient units exactly as sparsecard does it
(residual += grad; select; residual[selected] = 0):
  dense       plain distributed SGD (no compression)
  topk        sparsecar.kernels.ef_topk,      k = 0.2 % of the coordinates per worker and step
  threshold   sparsecar.kernels.ef_threshold, lambda = 4.2 (variable k)
The server averages the workers' selections and takes w -= gamma * average.

Measured: functional suboptimality f(w_t) - f* (f* from full-batch L-BFGS on the same objective
in float64), bits communicated by the workers (COO: 32-bit index + 32-bit value per selected
element; dense: 32 bits per coordinate; summed over workers; wire headers not counted), and the
error norm gamma * mean_w ||e_w|| (the model-space size of what error feedback still holds back).

Usage: paper_logreg.py [--short] [--out paper.json] [--plots DIR]
"""

import argparse
import json
import os
import sys
import time

import numpy as np


def make_gisette_like(samples, features, seed, informative=50, density=(0.05, 0.21), signal=4.0):
    """Seeded synthetic stand-in for gisette: ~13 % of the raw values are non-zero (in [0, 1]),
    then every feature is standardised (zero mean, unit variance), as one would preprocess
    gisette for logistic regression."""
    rng = np.random.default_rng(seed)
    p = rng.uniform(*density, size=features).astype(np.float32)         # per-feature occupancy
    mask = rng.random((samples, features), dtype=np.float32) < p
    u = np.where(mask, rng.random((samples, features), dtype=np.float32), np.float32(0))
    x = (u - u.mean(axis=0)) / np.maximum(u.std(axis=0), 1e-6)
    w_star = np.zeros(features)
    info = rng.choice(features, size=informative, replace=False)
    w_star[info] = signal * rng.standard_normal(informative)
    score = u @ w_star
    score -= score.mean()
    y = (rng.random(samples) < 1.0 / (1.0 + np.exp(-score))).astype(np.float32)
    return x.astype(np.float32), y


def loss(x, y, w, mu):
    m = x @ w
    return float(np.mean(np.logaddexp(0.0, m) - y * m) + 0.5 * mu * float(w @ w))


def optimum(x, y, mu):
    """f* by L-BFGS on the float64 objective (strongly convex: unique minimiser)."""
    from scipy.optimize import minimize
    from scipy.special import expit
    xd, yd = x.astype(np.float64), y.astype(np.float64)

    def fg(w):
        m = xd @ w
        f = np.mean(np.logaddexp(0.0, m) - yd * m) + 0.5 * mu * (w @ w)
        s = expit(m)
        g = xd.T @ (s - yd) / len(yd) + mu * w
        return f, g

    r = minimize(fg, np.zeros(x.shape[1]), jac=True, method="L-BFGS-B",
                 options={"maxiter": 20000, "maxfun": 40000, "ftol": 1e-15, "gtol": 1e-10})
    return float(r.fun), float(np.linalg.norm(fg(r.x)[1]))


def run_method(method, x, y, args, f_star, kernels):
    n, d = x.shape
    W = args.workers
    shards = [np.arange(w, n, W) for w in range(W)]
    rng = np.random.default_rng(args.seed + 7)
    w = np.zeros(d, dtype=np.float32)
    residual = np.zeros((W, d), dtype=np.float32)
    k = kernels.topk_count(d, args.density)
    per_epoch = min(len(s) for s in shards)
    iters = args.epochs * per_epoch
    bits = 0
    curve = []  # (iteration, epoch, suboptimality, bits, error_norm)
    total_sent = 0

    def record(t):
        err = args.gamma * float(np.mean(np.linalg.norm(residual, axis=1)))
        curve.append([t, t / per_epoch, loss(x, y, w, args.mu) - f_star, bits, err])

    record(0)
    t0 = time.monotonic()
    orders = None
    for t in range(iters):
        if t % per_epoch == 0:
            orders = [rng.permutation(s) for s in shards]
        rows = np.array([orders[i][t % per_epoch] for i in range(W)])
        xb = x[rows]                                          # W x d, one sample per worker
        s = 1.0 / (1.0 + np.exp(-(xb @ w)))
        grads = (xb * (s - y[rows])[:, None] + args.mu * w).astype(np.float32)
        if method == "dense":
            update = grads.mean(axis=0)
            bits += W * d * 32
        else:
            update = np.zeros(d, dtype=np.float32)
            for i in range(W):
                if method == "topk":
                    idx, val = kernels.ef_topk(residual[i], grads[i], k)
                else:
                    idx, val = kernels.ef_threshold(residual[i], grads[i], args.lam)
                update[idx] += val
                bits += 8 * kernels.coo_bytes(d, len(idx))
                total_sent += len(idx)
            update /= W
        w -= np.float32(args.gamma) * update
        if (t + 1) % args.eval_every == 0 or t + 1 == iters:
            record(t + 1)
    wall = time.monotonic() - t0
    return {"curve": curve, "iterations": iters, "wall_seconds": wall, "bits": bits,
            "final_suboptimality": curve[-1][2], "k": k if method == "topk" else None,
            "mean_density": (total_sent / (iters * W * d)) if method != "dense" else 1.0,
            "max_error_norm": max(c[4] for c in curve)}


def bits_to_reach(curve, target):
    for c in curve:
        if c[2] <= target:
            return c[3]
    return None


def first_epoch_below(curve, target):
    for c in curve:
        if c[2] <= target:
            return c[1]
    return None


def plot(results, target, outdir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(outdir, exist_ok=True)
    names = {"dense": "SGD (no compression)", "topk": "Top-k", "threshold": "Hard-threshold"}
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for i, (m, r) in enumerate(results.items()):
        color = f"C{i}"  # the same colour for a method in every panel
        c = np.array(r["curve"])
        label = names.get(m.split("@")[0], m) + (f" λ={m.split('@')[1]}" if "@" in m else "")
        ax[0].semilogy(c[:, 1], np.maximum(c[:, 2], 1e-12), label=label, color=color)
        ax[1].loglog(np.maximum(c[:, 3], 1), np.maximum(c[:, 2], 1e-12), label=label, color=color)
        if not m.startswith("dense"):
            ax[2].plot(c[:, 1], c[:, 4], label=label, color=color)
    for a in ax[:2]:
        a.axhline(target, color="grey", lw=0.8, ls="--")
        a.set_ylabel("f(w) - f*")
    ax[0].set_xlabel("epoch")
    ax[1].set_xlabel("bits communicated (all workers)")
    ax[2].set_xlabel("epoch")
    ax[2].set_ylabel("error norm  γ·mean‖e‖")
    for a in ax:
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.suptitle("Logistic regression, gisette-shaped synthetic, 20 workers, EF (sparsecar kernels)")
    fig.tight_layout()
    path = os.path.join(outdir, "paper-logreg.png")
    fig.savefig(path, dpi=110)
    return path


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="the test suite's short form (smaller, fewer epochs)")
    p.add_argument("--samples", type=int)
    p.add_argument("--features", type=int)
    p.add_argument("--workers", type=int, default=20)
    p.add_argument("--epochs", type=int)
    p.add_argument("--gamma", type=float, default=1.19e-3)
    p.add_argument("--mu", type=float, help="L2 weight (default 1/samples)")
    p.add_argument("--density", type=float, default=0.002, help="top-k fraction (default 0.2 %%)")
    p.add_argument("--lam", type=float, default=4.2, help="hard threshold lambda")
    p.add_argument("--extra-lams", default="", help="more lambdas to run, comma-separated")
    p.add_argument("--target-at", type=float, default=0.8,
                   help="target suboptimality = what dense SGD reaches after this fraction of its "
                        "iterations (default %(default)s)")
    p.add_argument("--eval-every", type=int)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="paper-logreg.json")
    p.add_argument("--plots", help="directory for paper-logreg.png")
    p.add_argument("--pythonpath", help="directory holding the sparsecar package (e.g. build/python)")
    args = p.parse_args(argv)
    if args.pythonpath:
        sys.path.insert(0, args.pythonpath)
    from sparsecar import kernels
    args.samples = args.samples or (2000 if args.short else 6000)
    args.features = args.features or (1000 if args.short else 5000)
    args.epochs = args.epochs or 10
    args.eval_every = args.eval_every or (20 if args.short else 30)
    args.mu = args.mu if args.mu is not None else 1.0 / args.samples

    t0 = time.monotonic()
    x, y = make_gisette_like(args.samples, args.features, args.seed)
    f_star, gnorm = optimum(x, y, args.mu)
    print(f"data {args.samples}x{args.features} ({100 * np.count_nonzero(x) / x.size:.1f}% non-zero), "
          f"f* = {f_star:.6f} (|grad| {gnorm:.1e}), {time.monotonic() - t0:.1f} s", flush=True)

    methods = [("dense", None), ("topk", None), ("threshold", args.lam)]
    methods += [("threshold", float(v)) for v in args.extra_lams.split(",") if v]
    results = {}
    for m, lam in methods:
        name = m if lam is None or lam == args.lam else f"{m}@{lam:g}"
        a = argparse.Namespace(**vars(args))
        if lam is not None:
            a.lam = lam
        r = run_method(m, x, y, a, f_star, kernels)
        r["lambda"] = lam
        results[name] = r
        print(f"  {name:<14} final f-f* {r['final_suboptimality']:.3e}  bits {r['bits']:.3e}  "
              f"density {100 * r['mean_density']:.3f}%  max err {r['max_error_norm']:.3f}  "
              f"{r['wall_seconds']:.1f} s", flush=True)

    dense_curve = results["dense"]["curve"]
    at = args.target_at * results["dense"]["iterations"]
    target = min(c[2] for c in dense_curve if c[0] <= at)
    summary = {
        "config": {k: getattr(args, k) for k in ("samples", "features", "workers", "epochs", "gamma", "mu",
                                                  "density", "lam", "seed", "short", "target_at")},
        "f_star": f_star,
        "target_suboptimality": target,
        "dense_bits": bits_to_reach(results["dense"]["curve"], target),
        "topk_bits": bits_to_reach(results["topk"]["curve"], target),
        "threshold_bits": bits_to_reach(results["threshold"]["curve"], target),
        "epochs_to_target": {m: first_epoch_below(r["curve"], target) for m, r in results.items()},
        "bits_to_target": {m: bits_to_reach(r["curve"], target) for m, r in results.items()},
        "final_suboptimality": {m: r["final_suboptimality"] for m, r in results.items()},
        "total_bits": {m: r["bits"] for m, r in results.items()},
        "mean_density": {m: r["mean_density"] for m, r in results.items()},
        "max_error_norm": {m: r["max_error_norm"] for m, r in results.items()},
        "runs": results,
    }
    print(f"target f-f* = {target:.3e} (dense SGD's after {100 * args.target_at:g}% of its iterations):")
    for m in results:
        b = summary["bits_to_target"][m]
        e = summary["epochs_to_target"][m]
        print(f"  {m:<14} reaches it at epoch {e if e is None else f'{e:.2f}'}, "
              f"after {'never' if b is None else f'{b:.3e} bits'}")
    if args.plots:
        print("plot:", plot(results, target, args.plots))
    with open(args.out, "w") as f:
        json.dump(summary, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
