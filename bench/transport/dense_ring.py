#!/usr/bin/env python3
"""The daemons' dense ring against torch's gloo all-reduce of the same tensor over the same link.

Two network namespaces joined by a veth pair shaped by tc tbf at each --rate (root). For each
rate and each sparsecard build: one job of two sparsecard nodes, one sparsecar_load_trainer each
(one tensor of --elements, a 1 ms sleep as the trainer's compute), every step a dense ring
(`--compression off` under the step controller, as the adaptive setting's dense steps run);
then, over the same link, torch.distributed's gloo all_reduce of a tensor of the same size
between one process per namespace (the baseline; without LD_LIBRARY_PATH), and the link's bound (the bytes one node sends
in a ring step over the rate). A ring step is the whole step (the trainer's copy in and out, its
compute, the daemon's work); gloo's is the all-reduce alone.

Usage: bench/transport/dense_ring.py --sparsecard [LABEL=]BIN ... --load-trainer BIN
           [--rate 1gbit ...] [--elements N] [--steps N] [--reps N]
"""
import argparse
import os
import statistics
import subprocess
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "controllers"))
sys.path.insert(0, os.path.join(HERE, "..", "convergence"))
import overhead  # noqa: E402  (run_job: one two-node job's ms per step)
from capped_net import CappedLink, rate_bits  # noqa: E402
from localjob import machine  # noqa: E402

RING_FLAGS = overhead.STEP_ARGS + ["--compression", "off"]

GLOO = r"""
import sys, time, torch, torch.distributed as dist
rank, addr, n, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo", init_method=f"tcp://{addr}:29571", rank=rank, world_size=2)
t = torch.ones(n)
for _ in range(5):
    dist.all_reduce(t)
dist.barrier()
t0 = time.perf_counter()
for _ in range(steps):
    dist.all_reduce(t)
if rank == 0:
    print((time.perf_counter() - t0) / steps * 1e3)
"""


def gloo_ms(link, python, elements, steps):
    procs = [subprocess.Popen(link.exec_argv(r, ["env", "-u", "LD_LIBRARY_PATH", f"GLOO_SOCKET_IFNAME={link.dev[r]}", python, "-c", GLOO,
                                                  str(r), link.addr[0], str(elements), str(steps)]),
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    out = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise SystemExit("dense_ring.py: the gloo baseline failed")
    return float(out[0].strip())


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sparsecard", action="append", required=True, metavar="[LABEL=]BIN")
    p.add_argument("--load-trainer", required=True)
    p.add_argument("--rate", action="append", help="tbf rate (repeatable; default 1gbit and 500mbit)")
    p.add_argument("--elements", type=int, default=1126410, help="the tensor (default: the large digits model's)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--python", default="/usr/bin/python3", help="a Python with torch, for the gloo baseline")
    args = p.parse_args(argv)
    rates = args.rate or ["1gbit", "500mbit"]
    if args.steps < 1 or args.reps < 1 or args.elements < 2:
        p.error("--steps and --reps must be >= 1, --elements >= 2")
    for r in rates:
        try:
            rate_bits(r)
        except ValueError as e:
            p.error(f"--rate: {e}")
    builds = {}
    for item in args.sparsecard:
        label, _, path = item.rpartition("=")
        if not os.access(path, os.X_OK):
            p.error(f"--sparsecard {path}: not an executable")
        builds[label or path] = path
    if not os.access(args.load_trainer, os.X_OK):
        p.error(f"--load-trainer {args.load_trainer}: not an executable")
    job_args = types.SimpleNamespace(density=0.005, steps=args.steps, compute_ms=1, elements=args.elements,
                                     load_trainer=args.load_trainer)
    ring_bytes = 2 * 4 * (args.elements // 2)  # W = 2: half the tensor each way, twice
    rows = []
    for rate in rates:
        with CappedLink(rate) as link:
            ring = {b: [] for b in builds}
            gloo = []
            for rep in range(args.reps):
                for b, path in builds.items():
                    ring[b].append(overhead.run_job(path, job_args, RING_FLAGS, link))
                gloo.append(gloo_ms(link, args.python, args.elements, args.steps))
                print(f"{rate} repetition {rep + 1}/{args.reps}: " +
                      ", ".join(f"{b} {ring[b][-1]:.2f}" for b in builds) + f", gloo {gloo[-1]:.2f} ms", flush=True)
            bound = ring_bytes * 8 / rate_bits(rate) * 1e3
            for b in builds:
                rows.append((rate, b, statistics.median(ring[b]), statistics.median(gloo), bound))
    m = machine()
    print(f"\n{m['cpus']} CPUs ({m['cpu']}), kernel {m['kernel']}; {args.elements} elements, {args.steps} steps x "
          f"{args.reps} repetitions (medians); ring: {' '.join(RING_FLAGS)}")
    print(f"{'rate':<9} {'build':<14} {'ring step ms':>12} {'gloo ms':>8} {'ring/gloo':>9} {'link bound ms':>13}")
    for rate, b, r, g, bound in rows:
        print(f"{rate:<9} {b:<14} {r:>12.2f} {g:>8.2f} {r / g:>9.3f} {bound:>13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
