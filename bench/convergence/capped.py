#!/usr/bin/python3
"""Time to accuracy on capped links: the DDP digits job of ddp_digits.py (2 nodes x 2 local ranks,
MLP on scikit-learn's digits) with each node in its own network namespace, the two joined by a
veth pair shaped by `tc tbf` on both ends, at each rate of --rates. Needs root.

Per rate, in namespace a: sparsecard rank 0 (coordinator on a's address) and DDP ranks 0, 1; in
namespace b: sparsecard rank 1 and DDP ranks 2, 3. Daemons: UCX tcp on the veth only; trainers:
gloo on the veth with MASTER_ADDR = a's address, so gloo's all-reduce (dense, PowerSGD, and
sparsecar's 2 dense warm-up iterations) crosses the capped link like the daemons' traffic does.
Traffic between the two ranks of a node stays inside its namespace (uncapped), as on a real node.
Each method runs as its own job (fresh trainers of ddp_digits.py --trainer; daemons only for
sparsecar), one after the other over the same link:

  dense      DDP's plain gloo all-reduce
  powersgd   torch's PowerSGD hook (rank 2)
  sparsecar  sparsecar.torch.register, daemons with --controller bandwidth (the trainer reports
             its compute time per step as metric compute_time; the controller keeps the exchange
             within that budget: caps the density, or switches to the dense ring when it fits)
  sparsecar_static  the same daemons with --controller static (fixed --density), for reference

Test accuracy is evaluated every --eval-every steps (evaluation time is kept out of the clock).
Per rate and method: time_to_accuracy_s = training seconds until the first evaluation at or above
the dense run's final test accuracy at that rate (null if never), final_accuracy, bytes = what
the two tbf qdiscs sent during that job (both directions, IP packets: TCP/IP, gloo and UCX framing,
rendezvous included), and counted_bytes = ddp_digits.py's node-level ring count (comparable with
`ddp` of bench-convergence.json). Before the runs, one TCP stream measures the link's goodput.

Usage (as root): capped.py --build-dir /path/to/release-build --out capped.json [--rates 100mbit,1gbit]
"""

import argparse
import json
import os
import re
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import ddp_digits  # noqa: E402
from capped_net import CappedLink  # noqa: E402
from localjob import LocalJob  # noqa: E402

PY = "/usr/bin/python3"
COORD_PORT = 29400   # fixed ports are safe: the namespaces are ours and empty
MASTER_PORT = 29500


def start_daemons(job, link, daemon_args, timeout=60.0):
    env = job.daemon_env()
    for node in range(2):
        env_n = dict(env, UCX_TLS="tcp", UCX_NET_DEVICES=link.dev[node])
        argv = [job.sparsecard, "--rank", str(node), "--world-size", "2",
                "--coordinator", f"{link.addr[0]}:{COORD_PORT}", "--socket", job.sockets[node],
                "--local-clients", str(job.local_clients), "--metrics-listen", "off",
                "--control", f"ipc://{job.dir}/control-{node}.sock", "--log-level", "info",
                "--ucx-tls", "tcp", "--ucx-net-devices", link.dev[node]] + daemon_args
        job.daemons.append(job.spawn(f"sparsecard node {node}", link.exec_argv(node, argv), env=env_n,
                                     log_name=f"sparsecard-{node}"))
    job.wait_for_sockets(timeout)


def decisions(log_path, limit=40):
    """The daemon's controller decisions ('decision epoch N from step S (...): knobs')."""
    out = []
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                m = re.search(r"decision epoch (\d+) from step (\d+)(.*)$", line)
                if m:
                    out.append(f"epoch {m.group(1)} step {m.group(2)}{m.group(3)}"[:300])
    except OSError:
        pass
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def qdisc_sent(link):
    """Bytes the two tbf qdiscs have sent so far (both directions of the link)."""
    total = 0
    for n in range(2):
        m = re.search(r"Sent (\d+) bytes", link.qdisc_stats(n))
        total += int(m.group(1)) if m else 0
    return total


def run_method(args, dargs, link, method, pythonpath):
    """One job (fresh trainers, and daemons for sparsecar) of one method over `link`."""
    trainer_method = "sparsecar" if method.startswith("sparsecar") else method
    daemon_args = ["--compression", dargs.compression, "--selector", dargs.selector,
                   "--density", repr(dargs.density), "--threshold", repr(dargs.threshold),
                   "--step-timeout-ms", str(int(dargs.daemon_step_timeout * 1000)),
                   "--controller", args.controller if method == "sparsecar" else "static"]
    if method == "sparsecar":
        daemon_args += args.daemon_arg
    dargs.methods = trainer_method
    sent0 = qdisc_sent(link)
    with LocalJob(args.sparsecard, nodes=2, local_clients=2, daemon_args=daemon_args, keep=args.keep_logs) as job:
        if trainer_method == "sparsecar":
            start_daemons(job, link, daemon_args)
        procs, outs = [], []
        world = 4
        for rank in range(world):
            node, local = divmod(rank, 2)
            env = job.daemon_env()
            env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": link.addr[0], "MASTER_PORT": str(MASTER_PORT),
                        "GLOO_SOCKET_IFNAME": link.dev[node], "OMP_NUM_THREADS": "1",
                        "PYTHONPATH": os.pathsep.join([pythonpath] + [p for p in [env.get("PYTHONPATH")] if p])})
            out = os.path.join(job.dir, f"trainer-{rank}.json")
            outs.append(out)
            argv = [PY, os.path.join(HERE, "ddp_digits.py"), "--trainer", "--out", out,
                    "--socket", job.sockets[node]] + ddp_digits._forward(dargs)
            procs.append(job.spawn(f"trainer rank {rank}", link.exec_argv(node, argv), env=env,
                                   log_name=f"trainer-{rank}"))
        t0 = time.monotonic()
        job.wait_all(procs, timeout=args.timeout)
        total_wall = time.monotonic() - t0
        ranks = []
        for out in outs:
            with open(out) as f:
                ranks.append(json.load(f))
        summary = ddp_digits.summarize(dargs, ranks, total_wall)
        e = summary["methods"][trainer_method]
        e["job_wall_seconds"] = total_wall
        if trainer_method == "sparsecar":
            e["daemon_args"] = daemon_args
            e["controller_decisions"] = decisions(os.path.join(job.dir, "sparsecard-0.log"))
        if args.keep_logs:
            print(f"  logs kept in {job.dir}", file=sys.stderr)
    e["link_bytes"] = qdisc_sent(link) - sent0
    return summary, e


def run_rate(args, dargs, rate, pythonpath):
    """Returns (config summary, {method: entry}, link info) for one rate."""
    with CappedLink(rate) as link:
        goodput = link.measure(PY, seconds=2.0)
        print(f"  link {link.dev[0]} <-> {link.dev[1]}: tbf {link.tbf}, one TCP stream {goodput:.0f} Mbit/s",
              flush=True)
        methods = {}
        for m in args.methods.split(","):
            summary, methods[m] = run_method(args, dargs, link, m, pythonpath)
            e = methods[m]
            print(f"  {m}: accuracy {100 * e['accuracy']:.2f}%, {e['wall_seconds']:.1f} s, "
                  f"{e['link_bytes']} bytes on the link", flush=True)
        info = {"tbf": link.tbf, "tcp_goodput_mbit": goodput, "qdisc": [link.qdisc_stats(n).strip() for n in range(2)]}
    return summary, methods, info


def time_to(curve, target):
    for steps, secs, acc in curve:
        if acc >= target - 1e-9:
            return secs, steps
    return None, None


def rate_entry(methods, link):
    target = methods["dense"]["accuracy"]
    entry = {"target_accuracy": target, "link": link}
    for m, e in methods.items():
        t, steps = time_to(e.get("curve", []), target)
        entry[m] = {"time_to_accuracy_s": t, "steps_to_accuracy": steps, "final_accuracy": e["accuracy"],
                    "bytes": e["link_bytes"], "counted_bytes": e["bytes"], "wall_seconds": e["wall_seconds"],
                    "curve": e.get("curve", [])}
        for k in ("job_wall_seconds", "compute_seconds", "hook_mode", "hook_failure", "density_measured",
                  "daemon_wire_bytes", "dense_warmup_bytes", "allreduce_calls", "daemon_args",
                  "controller_decisions"):
            if k in e:
                entry[m][k] = e[k]
    return entry


def print_table(capped):
    print(f"\n{'rate':<8} {'method':<16} {'target':>7} {'t->acc s':>9} {'steps':>6} {'final':>7} {'bytes':>12} "
          f"{'wall s':>7}")
    for rate, r in capped.items():
        if rate == "config":
            continue
        for m in ("dense", "powersgd", "sparsecar", "sparsecar_static"):
            if m not in r:
                continue
            e = r[m]
            t = f"{e['time_to_accuracy_s']:.1f}" if e["time_to_accuracy_s"] is not None else "never"
            st = str(e["steps_to_accuracy"]) if e["steps_to_accuracy"] is not None else "-"
            print(f"{rate:<8} {m:<16} {100 * r['target_accuracy']:>6.2f}% {t:>9} {st:>6} "
                  f"{100 * e['final_accuracy']:>6.2f}% {e['bytes']:>12} {e['wall_seconds']:>7.1f}")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", help="Release build holding daemon/sparsecard and python/")
    p.add_argument("--sparsecard", help="sparsecard binary (default: <build-dir>/daemon/sparsecard)")
    p.add_argument("--pythonpath", help="directory of the sparsecar package (default: <build-dir>/python)")
    p.add_argument("--rates", default="100mbit,1gbit", help="tc tbf rates, comma separated")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--methods", default="dense,powersgd,sparsecar,sparsecar_static",
                   help="dense must come first; sparsecar_static = the daemons without controller (--density)")
    p.add_argument("--density", type=float, default=0.005, help="sparsecar's base top-k density")
    p.add_argument("--controller", default="bandwidth", help="the daemons' --controller")
    p.add_argument("--daemon-arg", action="append", default=[],
                   help="extra sparsecard flag for the adaptive run (repeatable), e.g. --daemon-arg=--density-min=0.001")
    p.add_argument("--timeout", type=float, default=300.0, help="per method and rate (s)")
    p.add_argument("--out", default="bench-convergence-capped.json")
    p.add_argument("--keep-logs", action="store_true")
    args = p.parse_args(argv)
    if args.methods.split(",")[0] != "dense":
        p.error("--methods must start with dense (its final accuracy is the target)")
    if not args.build_dir and not (args.sparsecard and args.pythonpath):
        p.error("--build-dir (or both --sparsecard and --pythonpath) is required")
    args.sparsecard = args.sparsecard or os.path.join(args.build_dir, "daemon", "sparsecard")
    args.pythonpath = args.pythonpath or os.path.join(args.build_dir, "python")
    return args


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)  # unwinds through the teardowns


def main(argv):
    args = parse(argv)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    if os.geteuid() != 0:
        print("capped.py: needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    pythonpath = args.pythonpath
    for path in (args.sparsecard, pythonpath):
        if not os.path.exists(path):
            print(f"capped.py: {path} missing (build sparsecard and sparsecar_python)", file=sys.stderr)
            return 2
    dargs = ddp_digits.parse(["--methods", args.methods, "--steps", str(args.steps), "--density", repr(args.density),
                              "--eval-every", str(args.eval_every), "--report-compute-time"])
    capped = {}
    for rate in args.rates.split(","):
        print(f"== capped link {rate}: DDP digits, 2 namespaces x 2 ranks, {args.methods}", flush=True)
        summary, methods, link = run_rate(args, dargs, rate, pythonpath)
        capped[rate] = rate_entry(methods, link)
        print_table({rate: capped[rate]})
    config = {k: v for k, v in summary.items() if k not in ("methods", "total_wall_seconds")}
    config.update({"methods": args.methods, "eval_every": args.eval_every, "controller": args.controller, "daemon_args": args.daemon_arg,
                   "loadavg_end": os.getloadavg(), "cpus": os.cpu_count()})
    capped["config"] = config
    print_table(capped)
    with open(args.out, "w") as f:
        json.dump(capped, f, indent=1)
    print(f"\nwrote {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
