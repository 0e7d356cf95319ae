#!/usr/bin/python3
"""What a dense step is worth, in steps: the real jobs' training (bench/convergence/ddp_digits.py:
the same MLP, initialisation, shards, batches, SGD) simulated in one process, without daemons,
links or clocks, so that only the steps count. 4 ranks on 2 nodes (2 each, as the real jobs);
each step every rank's gradient of its own batch; a dense step applies their average (what DDP's
all-reduce or the daemons' ring gives); a sparse step sums each node's two ranks, adds the node's
residual, keeps the node's top-k of the whole flat gradient (the hook's one bucket) and averages
the nodes' selections (the daemons' top-k with `error_feedback = "residual"`). The hook's first
2 iterations are dense in every plan, as in the real jobs.

    bench/controllers/dense_worth.py [--dataset digits|fmnist] [--hidden 256] [--steps 600]
        [--seeds 1-4] [--density 0.005] [--momentum-correction]
        [--plan "dense:0-150,topk"] [--digits digits.npz] [--out r.json]
        [--step-ms dense=24/90,topk=19 [--phase-s 4] [--rate-changes alternating|once]]
    bench/controllers/dense_worth.py --reanalyse r.json[,r2.json] --step-ms dense=24/90,topk=19

A plan is a comma list of segments, each `dense` or `topk` with an optional step range
`A-B` or `A-` (from step A, before step B; without one, from where the segment before it ended,
to the end); where segments overlap the last one holding a step wins, and steps none holds are
top-k; `dense` and `topk` alone are the
static settings and always run. For every seed and plan it prints the steps to the target (the
dense run's final test accuracy less --target-margin-pp, as bench/controllers/real.py's
`--target-margin-pp`) and the ratio against dense: a static top-k's ratio is what a dense step
is worth in steps on this model (the step controller's `step_dense_worth` prices it at 1.3).
With --step-ms, a time model as well: each kind's step
time on a link that alternates between two rates every --phase-s seconds (`dense=24/90`: 24 ms
in the first phase, 90 in the second; the box's small `oscillating` job at 500 / 50 Mbit/s;
`--rate-changes once`: the second rate from --phase-s on, real.py's `up` and `down`), and each
plan's seconds to the target under it, paired per seed against dense and top-k (the geometric
mean and its 90 % interval, as real.py's) (--reanalyse: from saved reports). Also, per
sampled step of the top-k run, the statistics a daemon could see online: ||e||^2 /
||g||^2 (its residual against the gradient), the share of ||g + e||^2 the selection kept, the
share of ||g||^2 a top-k of g alone would keep, and (which a daemon sees only on a dense probe)
the cosine between the averaged selection and the dense average. With --momentum-correction
the hook's DGC momentum correction (docs of sparsecar.torch): every rank keeps u = m u + g, the
ranks' u go where g went, the optimizer runs without momentum and u is zeroed where the average
is nonzero; dense runs keep SGD's own momentum (the same update). A benchmark: nothing is
asserted. Docs: docs/controllers.md, "What a dense step is worth, in steps".
"""

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "convergence"))
sys.path.insert(0, HERE)
from real_metrics import paired_interval  # noqa: E402

NODES, LOCAL = 2, 2
SAMPLED = (2, 5, 10, 20, 50, 100, 200, 300, 400, 500)


def parse_plan(text):
    """[(kind, start, end)] of a --plan text (end None: open); SystemExit on a bad one."""
    segs = []
    for part in text.split(","):
        kind, _, span = part.strip().partition(":")
        if kind != "dense" and segment_density(kind) is None:
            raise SystemExit(f"--plan: unknown segment kind {kind!r} in {text!r} (dense, topk or topkP: "
                             "top-k of P % of the elements, 0 < P <= 100)")
        # Without a range a segment starts where the one before it ended (the first at step 0).
        start, end = (segs[-1][2] or 0) if segs else 0, None
        if span:
            a, sep, b = span.partition("-")
            try:
                start = int(a)
                end = int(b) if sep and b else None
            except ValueError:
                raise SystemExit(f"--plan: bad step range {span!r} in {text!r} (A-B or A-)") from None
            if start < 0 or (end is not None and end <= start):
                raise SystemExit(f"--plan: empty or negative step range {span!r} in {text!r}")
        segs.append((kind, start, end))
    return segs


def segment_density(kind, default=None):
    """A top-k segment's density: `topk` the --density (`default`), `topkP` P %; None: no top-k kind."""
    if kind == "topk":
        return default if default is not None else 0.0
    if not kind.startswith("topk"):
        return None
    try:
        pct = float(kind[4:])
    except ValueError:
        return None
    return pct / 100 if 0 < pct <= 100 else None


def kind_at(plan, step):
    """The plan's kind at `step`: the last segment holding it; steps no segment holds are top-k."""
    kind = "topk"
    for k, a, b in plan:
        if step >= a and (b is None or step < b):
            kind = k
    return kind


def parse_seeds(text):
    a, sep, b = text.partition("-")
    try:
        lo, hi = int(a), int(b) if sep else int(a)
    except ValueError:
        raise SystemExit(f"--seeds: {text!r} is not N or A-B") from None
    if lo < 1 or hi < lo:
        raise SystemExit(f"--seeds: {text!r} is no range of seeds >= 1")
    return list(range(lo, hi + 1))


def train(args, seed, plan, torch, np, shards, test):
    """(curve [[steps, test accuracy]], top-k statistics rows) of one run of `plan`."""
    import ddp_digits  # the jobs' own model (main() put bench/convergence on the path)
    world = NODES * LOCAL
    model = ddp_digits.make_mlp(torch, shards[0][0].shape[1], args.hidden, seed)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    mc = args.momentum_correction and any(kind != "dense" for kind, _, _ in plan)
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.0 if mc else args.momentum)
    gens = [np.random.default_rng(seed * 1000 + r) for r in range(world)]

    def batches(r):  # ddp_digits.trainer's own order
        xs, ys = shards[r]
        while True:
            order = gens[r].permutation(len(ys))
            for i in range(0, len(order) - args.batch + 1, args.batch):
                yield torch.from_numpy(xs[order[i:i + args.batch]]), torch.from_numpy(ys[order[i:i + args.batch]])

    its = [batches(r) for r in range(world)]
    residual = [torch.zeros(n) for _ in range(NODES)]
    velocity = [torch.zeros(n) for _ in range(world)]
    xt, yt = (torch.from_numpy(a) for a in test)
    curve, stats = [], []
    was = "dense"  # the hook's first iterations
    for step in range(args.steps):
        kind = "dense" if step < 2 else kind_at(plan, step)
        if args.momentum_reset and kind != "dense" and was == "dense" and step > 2:  # not after the hook's own
            opt.state.clear()  # SGD's momentum buffers: the dense steps' velocity dropped at the switch
        was = kind
        grads = []
        for r in range(world):
            x, y = next(its[r])
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        dense = sum(grads) / world
        if mc:
            for r in range(world):
                velocity[r].mul_(args.momentum).add_(grads[r])
            grads = [v.clone() for v in velocity]
        if kind == "dense":
            update = sum(grads) / world
            # A dense step sent everything: the residual went out with it (the daemons' first ring
            # step after sparse ones sends it) and u restarts there (the hook's). --switch-residual
            # drop / keep: an experiment, the residual dropped there (u kept), or kept for the
            # next sparse step (u kept).
            if args.switch_residual == "flush" and any(float(e.abs().max()) > 0 for e in residual):
                update += sum(residual) / world
                residual = [torch.zeros(n) for _ in range(NODES)]
                if mc:
                    velocity = [torch.zeros(n) for _ in range(world)]
            elif args.switch_residual == "drop":
                residual = [torch.zeros(n) for _ in range(NODES)]
        else:
            update = torch.zeros(n)
            g2 = e2 = a2 = kept = kept_alone = 0.0
            for node in range(NODES):
                g = sum(grads[node * LOCAL:(node + 1) * LOCAL])
                acc = g + residual[node]
                idx = acc.abs().topk(max(1, int(segment_density(kind, args.density) * n))).indices
                sel = torch.zeros(n)
                sel[idx] = acc[idx]
                residual[node] = acc - sel
                update += sel
                g2 += float(g.dot(g))
                e2 += float(residual[node].dot(residual[node]))
                a2 += float(acc.dot(acc))
                kept += float(sel.dot(sel))
                top = g.abs().topk(max(1, int(segment_density(kind, args.density) * n))).indices
                kept_alone += float(g[top].dot(g[top]))
            update /= world
            if mc:
                sent = update != 0
                for v in velocity:
                    v[sent] = 0
            if step in SAMPLED or step == args.steps - 1:
                cos = float(update.dot(dense) / (update.norm() * dense.norm() + 1e-30))
                stats.append({"step": step, "residual_over_grad": e2 / g2 if g2 > 0 else None,
                              "kept": kept / a2 if a2 > 0 else None,
                              "kept_alone": kept_alone / g2 if g2 > 0 else None, "cosine_with_dense": cos})
        offset = 0
        for p in params:
            p.grad = update[offset:offset + p.numel()].reshape(p.shape).clone()
            offset += p.numel()
        opt.step()
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            with torch.no_grad():
                curve.append([step + 1, float((model(xt).argmax(1) == yt).float().mean())])
    return curve, stats, n


def steps_to(curve, target):
    return next((s for s, a in curve if a >= target), None)


def parse_step_ms(text):
    """{kind: (ms in the first phase, ms in the second)} of a --step-ms text such as
    "dense=24/90,topk=19" (one value: both phases); dense and topk are required, a topkP kind
    without its own entry costs what topk does. SystemExit on a bad one."""
    costs = {}
    for part in text.split(","):
        kind, _, ms = part.strip().partition("=")
        if kind != "dense" and segment_density(kind) is None:
            raise SystemExit(f"--step-ms: unknown kind {kind!r} in {text!r}")
        try:
            vals = [float(v) for v in ms.split("/")]
        except ValueError:
            raise SystemExit(f"--step-ms: {ms!r} is not MS or MS/MS in {text!r}") from None
        if len(vals) not in (1, 2) or not all(v > 0 for v in vals):
            raise SystemExit(f"--step-ms: {kind} needs one or two times > 0 in {text!r}")
        costs[kind] = (vals[0], vals[-1])
    if "dense" not in costs or "topk" not in costs:
        raise SystemExit(f"--step-ms: {text!r} must give dense= and topk=")
    return costs


def seconds_to(plan, steps, costs, phase_s, once=False):
    """The wall time of a plan's first `steps` steps on a link whose rate alternates every
    phase_s seconds (the first phase first; `once`: the second rate from phase_s to the end, as
    real.py's `up` and `down`), each step costing its kind's ms in the phase it starts in; the
    hook's first 2 iterations are dense, as in train()."""
    t = 0.0
    for step in range(steps):
        kind = "dense" if step < 2 else kind_at(plan, step)
        ms = costs.get(kind, costs["dense" if kind == "dense" else "topk"])
        t += ms[min(1, int(t // phase_s)) if once else int(t // phase_s) % 2] / 1000
    return t


def paired_text(times, name, base):
    """The paired ratio of plan `name` to plan `base` over the seeds both reached: the geometric
    mean with its 90 % interval (real_metrics.paired_interval), as text."""
    pairs = [a / b for a, b in zip(times[name], times[base]) if a is not None and b is not None]
    if name == base or not pairs:
        return "-"
    iv = paired_interval(pairs)  # None for one pair: that pair alone
    return f"{pairs[0]:.3f} over 1" if iv is None else f"{iv[0]:.3f} [{iv[1]:.3f}-{iv[2]:.3f}] over {len(pairs)}"


def time_table(report, costs, phase_s, once=False):
    """Prints and returns {plan: per-seed seconds to the target} under --step-ms, with each seed's
    ratio to its dense run and to its top-k run (paired_text)."""
    seeds = sorted(report["seeds"], key=int)
    # The plans every seed ran (reports joined by --reanalyse may hold more on some seeds).
    names = [n for n in report["seeds"][seeds[0]]["runs"] if all(n in report["seeds"][s]["runs"] for s in seeds)]
    times = {}
    for name in names:
        plan = [("dense", 0, None)] if name == "dense" else [("topk", 0, None)] if name == "topk" else parse_plan(name)
        times[name] = [None if (st := report["seeds"][s]["runs"][name]["steps_to_target"]) is None
                       else seconds_to(plan, st, costs, phase_s, once) for s in seeds]
    link = f"the second rate from {phase_s:g} s on" if once else f"the link alternating every {phase_s:g} s"
    print(f"\nseconds to the target, {link}, step ms {costs}:\n"
          "| plan | s to the target (seeds) | median | paired x dense | paired x topk |\n| --- | --- | --- | --- | --- |")
    for name in names:
        t = times[name]
        known = [x for x in t if x is not None]
        print(f"| {name} | {', '.join('-' if x is None else f'{x:.2f}' for x in t)} | "
              f"{statistics.median(known):.2f} | " if known else f"| {name} | - | - | ", end="")
        print(f"{paired_text(times, name, 'dense')} | {paired_text(times, name, 'topk')} |")
    return times


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="digits", choices=("digits", "fmnist"))
    p.add_argument("--hidden", type=int, default=256, help="the MLP's width (real.py: small 256, large 1024)")
    p.add_argument("--batch", type=int, default=16, help="per rank")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--density", type=float, default=0.005, help="top-k's share of the elements")
    p.add_argument("--test-limit", type=int, default=0, help="fmnist: the first N test images (0: all)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--seeds", default="1", help="N or A-B (the trainer seeds, as real.py's)")
    p.add_argument("--target-margin-pp", type=float, default=0.5)
    p.add_argument("--momentum-correction", action="store_true", help="the hook's momentum_correction=True")
    p.add_argument("--switch-residual", choices=("flush", "drop", "keep"), default="flush",
                   help="at the first dense step after top-k ones: the residual goes out with it and the "
                        "hook's velocity restarts (flush: the daemons' and the hook's behaviour), or (an "
                        "experiment) it is dropped, or kept for the next top-k step")
    p.add_argument("--momentum-reset", action="store_true",
                   help="drop SGD's momentum buffers at every switch from dense to top-k (an experiment)")
    p.add_argument("--plan", action="append", default=[], help="one more plan (repeatable), e.g. dense:0-150,topk")
    p.add_argument("--digits", help="the digits as an .npz of x and y (ddp_digits.save_digits; default: scikit-learn's)")
    p.add_argument("--data-dir", help="fmnist: the directory of the IDX .gz files (default: Debian's "
                                      "dataset-fashion-mnist's)")
    p.add_argument("--step-ms", help="a time model, e.g. dense=24/90,topk=19: each kind's step in ms on a link "
                   "between two rates (--rate-changes; the first value's first); prints seconds to the target")
    p.add_argument("--phase-s", type=float, default=4.0)
    p.add_argument("--rate-changes", choices=["alternating", "once"], default="alternating",
                   help="the time model's link: the two rates alternate every --phase-s s, or the second "
                        "holds from --phase-s s on (real.py's up and down)")
    p.add_argument("--reanalyse", help="FILE[,FILE...]: reports of this tool, their seeds joined: only the tables (no training)")
    p.add_argument("--out", help="JSON report")
    args = p.parse_args(argv)
    costs = parse_step_ms(args.step_ms) if args.step_ms else None
    if args.phase_s <= 0:
        raise SystemExit("--phase-s must be > 0")
    if args.reanalyse:
        joined = {"seeds": {}}
        for path in args.reanalyse.split(","):
            with open(path) as f:
                r = json.load(f)
            for seed, v in r["seeds"].items():
                if seed in joined["seeds"]:
                    raise SystemExit(f"--reanalyse: seed {seed} is in two reports ({path})")
                joined["seeds"][seed] = v
        if costs is None:
            raise SystemExit("--reanalyse needs --step-ms (the steps are in the reports' own tables)")
        time_table(joined, costs, args.phase_s, args.rate_changes == "once")
        return 0
    if not 0 < args.density <= 1:
        raise SystemExit("--density must be in (0, 1]")
    if args.steps < 3 or args.eval_every < 1 or args.hidden < 1 or args.batch < 1:
        raise SystemExit("--steps >= 3, --eval-every, --hidden and --batch >= 1")
    seeds = parse_seeds(args.seeds)
    plans = {"dense": [("dense", 0, None)], "topk": [("topk", 0, None)]}
    for text in args.plan:
        plans[text] = parse_plan(text)

    import numpy as np
    import torch
    import ddp_digits
    torch.set_num_threads(1)
    t0 = time.monotonic()
    config = {k: v for k, v in vars(args).items() if k not in ("out", "plan")}
    if args.digits:
        config["digits"] = os.path.basename(args.digits)  # the report names no machine's paths
    if args.data_dir:
        config["data_dir"] = os.path.basename(os.path.normpath(args.data_dir))
    report = {"config": config | {"plans": list(plans)},
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}", "seeds": {}}
    print(f"dense_worth: {args.dataset} hidden {args.hidden}, top-k {100 * args.density:g} %, "
          f"{'momentum correction' if args.momentum_correction else 'SGD momentum'}; {report['machine']}", flush=True)
    for seed in seeds:
        dargs = ddp_digits.parse(["--dataset", args.dataset, "--hidden", str(args.hidden), "--seed", str(seed),
                                  "--test-limit", str(args.test_limit), "--batch", str(args.batch)]
                                 + (["--digits", args.digits] if args.digits else [])
                                 + (["--data-dir", args.data_dir] if args.data_dir else []))
        loaded = [ddp_digits.load_shard(dargs, r, NODES * LOCAL, np) for r in range(NODES * LOCAL)]
        shards, test = [s[0] for s in loaded], loaded[0][1]
        runs = {}
        for name, plan in plans.items():
            curve, stats, n = train(args, seed, plan, torch, np, shards, test)
            runs[name] = {"curve": curve, "final_accuracy": curve[-1][1]} | ({"topk_statistics": stats} if name == "topk" else {})
        target = runs["dense"]["final_accuracy"] - args.target_margin_pp / 100
        for r in runs.values():
            r["steps_to_target"] = steps_to(r["curve"], target)
        base = runs["dense"]["steps_to_target"]
        line = []
        for name, r in runs.items():
            s = r["steps_to_target"]
            r["steps_over_dense"] = s / base if s and base else None
            line.append(f"{name} {s if s else '-'}" + (f" (x{s / base:.2f})" if s and base and name != "dense" else ""))
        report["seeds"][str(seed)] = {"elements": n, "target": target, "runs": runs}
        print(f"  seed {seed}: {n} elements, target {100 * target:.2f} %: steps " + ", ".join(line)
              + f" ({time.monotonic() - t0:.0f} s so far)", flush=True)
    print("\n| plan | steps to the target (seeds) | x dense, median |\n| --- | --- | --- |")
    summary = {}
    for name in plans:
        steps = [report["seeds"][str(s)]["runs"][name]["steps_to_target"] for s in seeds]
        ratios = [report["seeds"][str(s)]["runs"][name]["steps_over_dense"] for s in seeds]
        known = [r for r in ratios if r is not None]
        summary[name] = {"steps": steps, "median_over_dense": statistics.median(known) if known else None}
        med = f"{statistics.median(known):.2f}" if known else "-"
        print(f"| {name} | {', '.join(str(s) if s else '-' for s in steps)} | {med} |")
    rows = [st for s in seeds for st in report["seeds"][str(s)]["runs"]["topk"]["topk_statistics"]]
    if rows:
        print("\ntop-k run, medians over seeds and sampled steps >= 10 (early, < 10, in the report):")
        late = [r for r in rows if r["step"] >= 10]
        for key in ("residual_over_grad", "kept", "kept_alone", "cosine_with_dense"):
            vals = [r[key] for r in late if r[key] is not None]
            summary[key] = statistics.median(vals) if vals else None
            print(f"  {key}: {summary[key]:.3f}" if vals else f"  {key}: -")
    report["summary"] = summary
    if costs is not None:
        report["seconds_to_target"] = time_table(report, costs, args.phase_s, args.rate_changes == "once")
    report["wall_s"] = time.monotonic() - t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
