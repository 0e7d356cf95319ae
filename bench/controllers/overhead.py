#!/usr/bin/python3
"""What a job-level controller costs a step, the plan unchanged: two sparsecard nodes on loopback
(or, with --rate, in two network namespaces joined by a veth pair shaped by tc tbf), one
sparsecar_load_trainer each (one tensor, a fixed sleep as the trainer's compute), the same
static top-k plan under `--controller static` (the baseline) and under the step controller held
to that plan (`--controller step` with one candidate: no ring, density_max = the density), each
set of jobs run back to back and repeated; the cost is the paired difference of their mean step
times (ms per step over the whole run, the trainers' start-up included alike).

    bench/controllers/overhead.py --sparsecard BIN [--sparsecard LABEL=BIN ...]
                                  --load-trainer BUILD/tests/integration/metrics/sparsecar_load_trainer
                                  [--steps 1500] [--reps 6] [--elements 85000] [--compute-ms 1]
                                  [--rate 200mbit] [--variant LABEL="--step-timed-send-every 16" ...]

Several --sparsecard builds are interleaved within each repetition (e.g. before and after a
change), and so are the step controller's --variant jobs (its extra sparsecard flags; without
any, one variant `step` with none). Prints one row per build and variant: the baseline's median
ms/step, the controller's, the median of the paired differences (us/step) and their ratio, and
the machine. --rate (root: network namespaces, tc) puts the two nodes behind a shaper, where a
timed send's extra round trip waits behind the queued bytes, which loopback hides. Docs:
docs/controllers.md, "Timed sends and the controllers' work after the step"."""

import argparse
import contextlib
import os
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "convergence"))
from localjob import LocalJob, machine  # noqa: E402
import capped  # noqa: E402  (start_daemons: one sparsecard per namespace)
from capped_net import CappedLink, rate_bits  # noqa: E402

BASELINE = "static"
STATIC_ARGS = ["--controller", "static", "--selector", "topk"]
STEP_ARGS = ["--controller", "step", "--selector", "topk", "--step-allow-dense", "off"]


def run_job(sparsecard, args, flags, link):
    """Mean ms per step of one job (both trainers' wall time from spawning them); `flags`: the
    sparsecard flags of the job's controller; `link`: a CappedLink, or None for loopback."""
    daemon_args = flags + ["--density", repr(args.density)]
    with LocalJob(sparsecard, nodes=2, local_clients=1, daemon_args=daemon_args) as job:
        if link is None:
            job.start_daemons()
        else:
            capped.start_daemons(job, link, daemon_args)
        t0 = time.monotonic()
        argv = [[args.load_trainer, job.sockets[r], str(args.steps), str(args.compute_ms), str(args.elements)]
                for r in range(2)]
        if link is not None:
            argv = [link.exec_argv(r, a) for r, a in enumerate(argv)]
        procs = [job.spawn(f"trainer {r}", argv[r], env=job.daemon_env()) for r in range(2)]
        for p in procs:
            p.wait()
        seconds = time.monotonic() - t0
        failed = [p.returncode for p in procs if p.returncode != 0]
        if failed:
            raise SystemExit(f"overhead.py: a load trainer failed (exit {failed[0]}); logs in {job.dir}")
    return seconds / args.steps * 1e3


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sparsecard", action="append", required=True, metavar="[LABEL=]BIN")
    p.add_argument("--load-trainer", required=True)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--elements", type=int, default=85000, help="the one tensor's elements (the digits MLP's ~85 k)")
    p.add_argument("--compute-ms", type=int, default=1, help="the trainer's compute per step (a sleep, whole ms)")
    p.add_argument("--density", type=float, default=0.005)
    p.add_argument("--rate", help="shape the link between the nodes with tc tbf at this rate (e.g. 200mbit; root)")
    p.add_argument("--variant", action="append", default=[], metavar='LABEL="FLAGS"',
                   help="a step-controller job with these extra sparsecard flags (repeatable)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.reps < 1 or args.elements < 1 or args.compute_ms < 0 or not 0 < args.density <= 1:
        p.error("--steps, --reps and --elements must be >= 1, --compute-ms >= 0, --density in (0, 1]")
    builds = {}
    for item in args.sparsecard:
        label, _, path = item.rpartition("=")
        label = label or os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(path)))) or path
        if not os.access(path, os.X_OK):
            p.error(f"--sparsecard {path}: not an executable")
        builds[label] = path
    if not os.access(args.load_trainer, os.X_OK):
        p.error(f"--load-trainer {args.load_trainer}: not an executable")
    if args.rate is not None:
        try:
            rate_bits(args.rate)  # its spelling, before any job runs
        except ValueError as e:
            p.error(f"--rate: {e}")
    configs = {BASELINE: STATIC_ARGS}
    for item in args.variant or ["step="]:
        label, sep, flags = item.partition("=")
        if not sep or not label or label in configs:
            p.error(f"--variant {item!r}: want LABEL=\"FLAGS\" with a new label other than {BASELINE}")
        configs[label] = STEP_ARGS + ["--density-max", repr(args.density)] + shlex.split(flags)
    times = {(b, c): [] for b in builds for c in configs}
    with (CappedLink(args.rate) if args.rate else contextlib.nullcontext()) as link:
        for rep in range(args.reps):
            for b, path in builds.items():
                for c, flags in configs.items():
                    times[(b, c)].append(run_job(path, args, flags, link))
            print(f"repetition {rep + 1}/{args.reps}: " + ", ".join(
                f"{b} {c} {times[(b, c)][-1]:.3f}" for b in builds for c in configs) + " ms/step", flush=True)
        where = f"tbf {link.tbf} on a veth pair" if link else "loopback"
    m = machine()
    print(f"\n{m['cpus']} CPUs ({m['cpu']}), kernel {m['kernel']}, load {os.getloadavg()[0]:.2f}; {args.steps} steps x "
          f"{args.reps} repetitions, {args.elements} elements, {args.compute_ms} ms compute, top-k {args.density:g}, {where}")
    for c, flags in configs.items():
        if c != BASELINE:
            print(f"  {c}: {' '.join(flags)}")
    print(f"{'build':<16} {'variant':<12} {'static ms':>9} {'step ms':>9} {'step - static us (paired median)':>33} {'ratio':>6}")
    for b in builds:
        base = times[(b, BASELINE)]
        for c in configs:
            if c == BASELINE:
                continue
            ctl = times[(b, c)]
            diff = statistics.median(s - t for s, t in zip(ctl, base))
            print(f"{b:<16} {c:<12} {statistics.median(base):>9.3f} {statistics.median(ctl):>9.3f} {diff * 1e3:>33.0f} "
                  f"{statistics.median(ctl) / statistics.median(base):>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
