#!/usr/bin/env python3
"""How long sparsecar.Client.submit() takes while another thread of the same client waits on a
step in flight: what a DDP trainer does at every bucket after the first (the hook's completion
thread waits on bucket 0 while backward hands over bucket 1, 2, ...).

Two daemons on loopback (compression off), one client per node, two tensors x and y of --elements
floats. Per step node 0 submits x, a second thread waits on it, and --delay-ms later node 0
submits y (timed); node 1 then submits both and every wait returns. The baseline, in the same run:
the same submit(y) with no wait in flight. Prints a table (median, p90, max in ms; the ratio of
the medians) and the machine.

    bench/client/submit_while_waiting.py --build-dir build [--steps 60] [--delay-ms 20]

Needs the sparsecar Python extension (<build-dir>/python) and <build-dir>/daemon/sparsecard.
A benchmark: nothing is asserted. Results: docs/benchmarks.md, "submit() while another thread waits".
"""
import argparse
import os
import platform
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "convergence"))
from localjob import LocalJob  # noqa: E402


def machine():
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.node()}: {os.cpu_count()} CPUs, {model}, Linux {platform.release()}"


def quantiles(xs):
    s = sorted(xs)
    return statistics.median(s), s[min(len(s) - 1, int(0.9 * len(s)))], s[-1]


def run(args):
    import sparsecar
    job = LocalJob(args.sparsecard, nodes=2, local_clients=1, daemon_args=["--compression", "off"])
    with job:
        job.start_daemons()
        cs = [sparsecar.Client(s, timeout=10) for s in job.sockets]
        xs = [c.register("x", args.elements) for c in cs]
        ys = [c.register("y", args.elements) for c in cs]
        alone, waiting = [], []
        step = 0
        for i in range(2 * args.steps):
            step += 1
            concurrent = i % 2 == 1  # interleaved: both cases see the same state of the machine
            cs[0].submit(xs[0], step)
            th = None
            if concurrent:
                th = threading.Thread(target=cs[0].wait, args=(xs[0], step, 30.0))
                th.start()
            time.sleep(args.delay_ms / 1e3)
            t = time.perf_counter()
            cs[0].submit(ys[0], step)
            (waiting if concurrent else alone).append((time.perf_counter() - t) * 1e3)
            cs[1].submit(xs[1], step)
            cs[1].submit(ys[1], step)
            if th is not None:
                th.join(30)
                if th.is_alive():
                    raise SystemExit("a wait did not return within 30 s")
            else:
                cs[0].wait(xs[0], step, 30.0)
            for c, y in ((cs[0], ys[0]), (cs[1], xs[1]), (cs[1], ys[1])):
                c.wait(y, step, 30.0)
        for c in cs:
            c.close()
    return alone, waiting


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", help="build tree holding daemon/sparsecard and python/")
    p.add_argument("--sparsecard", help="default: <build-dir>/daemon/sparsecard")
    p.add_argument("--steps", type=int, default=60, help="timed submits per case (default 60)")
    p.add_argument("--delay-ms", type=float, default=20.0,
                   help="between the first submit (and the wait starting) and the timed one (default 20)")
    p.add_argument("--elements", type=int, default=1000, help="floats per tensor (default 1000)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.delay_ms < 0 or args.elements < 1:
        p.error("--steps and --elements must be >= 1, --delay-ms >= 0")
    if args.sparsecard is None:
        if args.build_dir is None:
            p.error("give --build-dir or --sparsecard")
        args.sparsecard = os.path.join(args.build_dir, "daemon", "sparsecard")
    if args.build_dir:
        sys.path.insert(0, os.path.join(args.build_dir, "python"))
    if not os.access(args.sparsecard, os.X_OK):
        p.error(f"{args.sparsecard} is not an executable")
    alone, waiting = run(args)
    base = quantiles(alone)
    print(f"machine: {machine()}")
    print(f"submit() of {args.elements} floats, {args.steps} per case, {args.delay_ms:g} ms after the first submit")
    print(f"{'case':<44} {'median ms':>10} {'p90 ms':>8} {'max ms':>8} {'vs baseline':>12}")
    for name, xs in (("baseline: no wait in flight", alone), ("another thread waits on a step in flight", waiting)):
        med, p90, mx = quantiles(xs)
        print(f"{name:<44} {med:>10.3f} {p90:>8.3f} {mx:>8.3f} {med / base[0]:>11.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
