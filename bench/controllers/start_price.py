#!/usr/bin/python3
"""The step controller's weighing before the first step, replayed on real jobs' reports: how often
the warm-up cut on the trainer's start hint would be right at a given kStartSparseFactor.

Before any sparse step has run, policies' StepController::before_start prices a sparse step at
FACTOR x the trainer's dense step less its exchange wait (its "rest") and cuts the schedule's dense
warm-up where the dense step costs more than CUT (step_warmup_cut) such sparse steps. Each seed of a
`scripts/bench controllers --real` report holds both sides: the adaptive job's hint (dense_step_s,
dense_wait_s) and the static top-k job's early steps on the same link (the same seed), i.e. what a
sparse step then cost. A call is wrong where the priced ratio and the measured one fall on
different sides of CUT.

    bench/controllers/start_price.py REPORT.json [REPORT.json ...] [--factors 3,2.5,2] [--cut 2]
                                     [--static topk0.5] [--hinted adaptive] [--rows]
                                     [--dense-iterations N]

--dense-iterations N replays the hint of a hook that ran only its first N dense iterations: each
job's hint recomputed from the first N of its dense_timings_s as the hook does (the quickest
period, and that period less the least rest), e.g. 2 for the hook of 2026-12-03 on reports whose
large-model jobs ran three.

Prints one row per factor (calls, wrong cuts, wrong keeps; per machine), and with --rows each
seed's ratios. Docs: docs/controllers.md, "The pre-start price of a sparse step"."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import real_metrics as rm  # noqa: E402


def machine_of(report):
    m = (report.get("config") or {}).get("machine") or {}
    return f"{m.get('cpus', '?')} cpus, {m.get('cpu', '?')}"


def seeds_of(path, report, static, hinted):
    """(label, machine, hinted entry, static entry) per seed and profile of one report."""
    machine = machine_of(report)
    for model, m in (report.get("models") or {}).items():
        for seed, sd in (m.get("seeds") or {}).items():
            for profile, p in (sd.get("profiles") or {}).items():
                settings = p.get("settings") or {}
                if static in settings and hinted in settings:
                    label = f"{os.path.basename(path)} {model} {profile} seed {seed}"
                    yield label, machine, settings[hinted], settings[static]


def first_iterations_hint(entry, n):
    """`entry` (a job of a report) with the hint of its first n dense iterations (the hook's
    _start_timing over dense_timings_s[:n], restated here: this script runs without torch, which
    importing sparsecar.torch needs); the entry itself where it holds no timings."""
    timings = [t for t in (entry.get("dense_timings_s") or [])[:n] if isinstance(t, (list, tuple)) and len(t) == 2]
    if not timings:
        return entry
    period = min(p for p, _ in timings)
    rest = min(p - w for p, w in timings)
    return dict(entry, dense_step_s=period, dense_wait_s=min(max(period - rest, 0.0), period))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", metavar="REPORT.json")
    p.add_argument("--factors", default="3,2.5,2", help="kStartSparseFactor values to replay (default 3,2.5,2)")
    p.add_argument("--cut", type=float, default=2.0, help="step_warmup_cut (default 2)")
    p.add_argument("--static", default="topk0.5", help="the static sparse setting whose steps are the truth")
    p.add_argument("--hinted", default="adaptive", help="the setting whose trainers' dense steps were the hint")
    p.add_argument("--rows", action="store_true", help="print every seed's ratios")
    p.add_argument("--dense-iterations", type=int, default=0,
                   help="replay the hint of the first N dense iterations only (default: the report's hint)")
    args = p.parse_args(argv)
    try:
        factors = [float(x) for x in args.factors.split(",")]
    except ValueError:
        p.error(f"--factors: not a list of numbers: {args.factors!r}")
    if not factors or any(not f > 0 for f in factors) or not args.cut > 0:
        p.error("--factors and --cut must be positive")
    seeds = []
    for path in args.reports:
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, ValueError) as e:
            p.error(f"{path}: {e}")
        seeds.extend(seeds_of(path, report, args.static, args.hinted))
    if not seeds:
        p.error(f"no seed holds both {args.static!r} and {args.hinted!r} in these reports")
    machines = sorted({m for _, m, _, _ in seeds})
    print(f"{len(seeds)} seeds; step_warmup_cut {args.cut:g}; truth: the dense step / {args.static}'s median "
          f"step over steps 3-39; machines: {'; '.join(machines)}")
    print(f"{'factor':>7} {'calls':>6} {'wrong cuts':>11} {'wrong keeps':>12}   per machine (wrong / calls)")
    for factor in factors:
        calls, cuts, keeps, per = 0, 0, 0, {}
        for label, machine, hinted, static in seeds:
            if args.dense_iterations > 0:
                hinted = first_iterations_hint(hinted, args.dense_iterations)
            r = rm.start_price(hinted, static, factor)
            if r is None:
                continue
            priced, measured = r
            calls += 1
            wrong_cut = priced > args.cut >= measured
            wrong_keep = measured > args.cut >= priced
            cuts += wrong_cut
            keeps += wrong_keep
            w, n = per.get(machine, (0, 0))
            per[machine] = (w + (wrong_cut or wrong_keep), n + 1)
            if args.rows:
                mark = " wrong cut" if wrong_cut else " wrong keep" if wrong_keep else ""
                print(f"    x{factor:g} {label}: priced {priced:.2f}, measured {measured:.2f}{mark}")
        split = "; ".join(f"{m}: {w}/{n}" for m, (w, n) in sorted(per.items()))
        print(f"{factor:>7g} {calls:>6} {cuts:>11} {keeps:>12}   {split}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
