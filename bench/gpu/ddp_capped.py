#!/usr/bin/env python3
"""DDP over a capped link between two "nodes" of one machine: dense NCCL (or gloo) all-reduce,
torch's PowerSGD hook and sparsecar in the same run (issue 13's evidence). Needs root for the
capped rates.

Two "nodes" of one machine, each with --local-ranks N trainer processes (default 1: two GPUs, or
two CPU processes with --device cpu; N = 2: 2 nodes x 2 GPUs on a 4-GPU host). For a rate such as
1gbit, each node's trainers (and, for sparsecar, its sparsecard) run in the node's own network
namespace; the two are joined by one veth pair shaped by `tc tbf` on both ends
(bench/convergence/capped_net.py). NCCL is forced onto that veth in every process
(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=<veth>; gloo:
GLOO_SOCKET_IFNAME=<veth>): between the nodes it crosses the cap, between the local ranks of one
node it stays inside the namespace (uncapped). The daemons use UCX tcp on the veth.
Rate "none" means no namespaces and no NCCL restrictions: plain NCCL as it comes (NVLink between
GPUs of one host), the "at most 2x plain DDP" baseline; its daemons use UCX tcp on loopback.
Processes: torch.distributed's world is 2 x N, global RANK = node * N + local, LOCAL_RANK = local;
every trainer of node r gets SPARSECAR_NODE_RANK=r SPARSECAR_NNODES=2 (the hook's node values),
and node r's sparsecard runs with --local-clients N (it averages over its N trainers).
GPUs: --gpus lists 2 x N indices, node r taking the r-th N of them (default 0..2N-1; N = 2:
node 0 gets 0,1, node 1 gets 2,3). Under a cap, each trainer (bench/gpu/ddp_trainer.py) sees only
its own GPU (CUDA_VISIBLE_DEVICES, as with one rank per node) and node r's daemon sees node r's
GPUs (it opens each trainer's buffers on its GPU by device UUID); uncapped, every trainer sees all
GPUs, as under a plain torchrun on one host, so that NCCL may take its P2P (NVLink) path; each run
records the transport NCCL logged (rank 0's log).

Parts (--part):
  step  for every rate, model (--models) and method (--methods): median / p10 / p90 step time
        after the warm-up (ddp_trainer.py says how it is timed), sparsecar's payload bytes per
        step (the hook's summary), the bytes the two tbf qdiscs sent during the run, the
        transport NCCL reported, and per rate the ratio of every method's median to dense's and
        to PowerSGD's from the same run.
  tta   Fashion-MNIST, --tta-model (fmnist_cnn, or the wider fmnist_resnet whose all-reduce
        dominates its step at 1 Gbit/s), 2 nodes (x --local-ranks) at --tta-rate: dense,
        powersgd, sparsecar (static top-k at --tta-density), sparsecar_bandwidth
        (--controller bandwidth) and sparsecar_adaptive (the controllers' default: --controller
        schedule,step with its 6-step dense warm-up, top-k at --tta-density; the trainer reports
        its compute time to both): test accuracy over
        training wall time (evaluation kept out of the clock), time to dense's final accuracy, final accuracy, and the accuracy
        each method had after as many steps as dense ran. Dense runs --tta-epochs; the
        compressed methods may run longer (--tta-epochs-compressed): their steps are cheaper,
        and the target is a time.
Each run is its own set of 2 x N trainer processes (and daemons); a run over --run-timeout is
killed, a failed run is reported with its log's tail and the matrix goes on (exit status 1 at the
end). Every run checks that all 2 x N ranks end with identical parameters (a SHA-256 of each
rank's parameters, gathered over the ranks); a difference fails the run. Each run entry holds
every rank's JSON ("ranks"), local_ranks, world, and for sparsecar the local clients each daemon
expected and saw connect (daemon_local_clients, from its log).
Runs that would start after --total-budget-s are skipped, so one call ends in time. The results
JSON is rewritten after every run.

  bench/gpu/ddp-run .gpu-bundle OUT [--quick]     # on the GPU machine: builds build-gpu-py/, then
  ddp_capped.py --bin .gpu-bundle/bin --lib .gpu-bundle/lib --pythonpath build-gpu-py --out-dir OUT
  bench/gpu/ddp-run .gpu-bundle OUT --local-ranks 2   # 4 GPUs: 2 nodes x 2 GPUs (--gpus 0,1,2,3)
  ddp_capped.py --device cpu --build-dir build --models tiny --rates 100mbit --part step --out-dir OUT
"""

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench", "convergence"))

from capped import decisions  # noqa: E402
from capped_net import CappedLink, rate_bits  # noqa: E402
from localjob import JobError, LocalJob, machine, tail  # noqa: E402

FMNIST_MODELS = ("fmnist_cnn", "fmnist_resnet")  # the tta part's models (ddp_trainer.py)

TRAINER = os.path.join(HERE, "ddp_trainer.py")
COORD_PORT = 29400   # inside our own namespaces: nothing else listens there
MASTER_PORT = 29500
SKIPPED = 3          # ddp_trainer.py's exit status for "cannot run here"
NCCL_VETH = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME")
TTA_METHODS = ("dense", "powersgd", "sparsecar", "sparsecar_bandwidth", "sparsecar_adaptive")
# The daemons' controller flags per sparsecar method (sparsecar_adaptive: docs/controllers.md's default).
CONTROLLER_FLAGS = {"sparsecar": ["--controller", "static"],
                    "sparsecar_bandwidth": ["--controller", "bandwidth"],
                    "sparsecar_adaptive": ["--controller", "schedule,step", "--schedule-warmup-steps", "6"]}
CONTROLLED = ("sparsecar_bandwidth", "sparsecar_adaptive")  # their trainers report compute time; decisions read
HINT = re.compile(r"the trainer's dense steps before step (\d+): ([0-9.e+-]+) ms a step, ([0-9.e+-]+) ms of it "
                  r"waiting on the exchange")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Link:
    """Where a run's two nodes live: a CappedLink (namespaces, veth, tbf), or the host (rate none)."""

    def __init__(self, rate):
        self.rate = rate
        self.capped = rate != "none"
        self._link = CappedLink(rate) if self.capped else None
        self.info = {"rate": rate}

    def __enter__(self):
        if self._link:
            self._link.__enter__()
        return self

    def __exit__(self, *exc):
        if self._link:
            self._link.__exit__(*exc)
        return False

    def addr(self, node):
        return self._link.addr[node] if self.capped else "127.0.0.1"

    def dev(self, node):
        return self._link.dev[node] if self.capped else "lo"

    def argv(self, node, argv):
        return self._link.exec_argv(node, argv) if self.capped else list(argv)

    def sent_bytes(self):
        if not self.capped:
            return None
        total = 0
        for n in range(2):
            m = re.search(r"Sent (\d+) bytes", self._link.qdisc_stats(n))
            total += int(m.group(1)) if m else 0
        return total

    def check(self, python):
        if self.capped:
            goodput = self._link.measure(python, seconds=2.0)
            self.info.update(tbf=self._link.tbf, tcp_goodput_mbit=round(goodput, 1), devices=self._link.dev,
                             namespaces=self._link.ns)
            print(f"  link {self._link.dev[0]} <-> {self._link.dev[1]}: tbf {self._link.tbf}, one TCP stream "
                  f"{goodput:.0f} Mbit/s", flush=True)
        else:
            self.info.update(note="no namespaces, no tbf: NCCL as it comes (NVLink between GPUs of one host); "
                                  "sparsecar daemons on loopback TCP")
            print("  uncapped: no namespaces, plain NCCL (NVLink if present), daemons on loopback", flush=True)


# ---- one run ------------------------------------------------------------------------------------
def daemon_flags(args, method, density):
    flags = ["--compression", "on", "--selector", args.selector, "--density", repr(density),
             *CONTROLLER_FLAGS[method], "--kernel-threads", str(args.kernel_threads)]
    return flags + args.daemon_arg


NODES = 2  # one veth pair joins two namespaces (CappedLink)


def node_gpus(args, node):
    """The --gpus entries of node `node`: the node-th run of --local-ranks of them."""
    n = args.local_ranks
    return args.gpus[node * n:(node + 1) * n]


def processes(args):
    """(global rank, node, local rank) of every trainer: rank = node * local_ranks + local."""
    return [(node * args.local_ranks + local, node, local)
            for node in range(NODES) for local in range(args.local_ranks)]


def start_daemons(args, job, link, flags, timeout=60.0):
    port = COORD_PORT if link.capped else free_port()
    for node in range(NODES):
        env = dict(job.daemon_env(), UCX_TLS="tcp", UCX_NET_DEVICES=link.dev(node))
        if args.device == "cuda":
            # A node's daemon sees its node's GPUs only (it finds a trainer's buffers by device UUID;
            # with several, it sums on the first one's GPU and peer-copies the others).
            env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus(args, node))
        argv = [args.sparsecard, "--rank", str(node), "--world-size", str(NODES),
                "--coordinator", f"{link.addr(0)}:{port}", "--socket", job.sockets[node],
                "--local-clients", str(args.local_ranks), "--metrics-listen", "off",
                "--control", f"ipc://{os.path.dirname(job.sockets[node])}/control-{node}.sock", "--log-level", "info",
                "--ucx-tls", "tcp", "--ucx-net-devices", link.dev(node)] + flags
        job.daemons.append(job.spawn(f"sparsecard node {node}", link.argv(node, argv), env=env,
                                     log_name=f"sparsecard-{node}"))
    job.wait_for_sockets(timeout)


def trainer_env(args, job, link, node, local, port):
    env = job.daemon_env()  # the launcher variables of an outer job removed
    for k in NCCL_VETH + ("GLOO_SOCKET_IFNAME",):
        env.pop(k, None)
    n = args.local_ranks
    env.update({"RANK": str(node * n + local), "WORLD_SIZE": str(NODES * n), "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": link.addr(0), "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": link.dev(node),
                # the hook's node values (its daemon serves the node, not the process)
                "SPARSECAR_NODE_RANK": str(node), "SPARSECAR_NNODES": str(NODES), "PYTHONUNBUFFERED": "1",
                "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
                "PYTHONPATH": os.pathsep.join(p for p in (args.pythonpath, env.get("PYTHONPATH")) if p)})
    if args.device == "cuda" and link.capped:
        # Each trainer sees only its own GPU: NCCL cannot find a P2P (NVLink) path to any other GPU,
        # neither the other node's nor a local rank's (its daemon sees all GPUs of the node).
        env["CUDA_VISIBLE_DEVICES"] = args.gpus[node * n + local]
    if link.capped:
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1",
                   NCCL_SOCKET_IFNAME=link.dev(node))
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(args.threads or 1))
    return env


def trainer_prefix(args):
    """The trainers get the LD_LIBRARY_PATH this script started with, not --lib: the bundle's
    Debian libraries (libz, libnuma, ...) are for sparsecard, ip and tc only, and must not shadow
    the GPU machine's own under Python and torch. (`ip netns exec` passes its environment on.)"""
    if not args.lib:
        return []
    if args.orig_ld_library_path:
        return ["env", f"LD_LIBRARY_PATH={args.orig_ld_library_path}"]
    return ["env", "-u", "LD_LIBRARY_PATH"]


def trainer_python(args):
    """args.python as a single program that starts with the trainers' LD_LIBRARY_PATH (a wrapper
    script in --out-dir when --lib is set): for CappedLink.measure, which takes one path."""
    prefix = trainer_prefix(args)
    if not prefix:
        return args.python
    path = os.path.join(os.path.abspath(args.out_dir), "python-trainer-env")
    with open(path, "w") as f:
        f.write("#!/bin/sh\nexec " + " ".join(shlex.quote(a) for a in prefix + [args.python]) + ' "$@"\n')
    os.chmod(path, 0o755)
    return path


def gpu_index(args, link, node, local):
    """The trainer's --gpu: 0 under a capped link (CUDA_VISIBLE_DEVICES holds the trainer's own GPU,
    --gpus[rank], only); uncapped, every GPU stays visible and global rank g uses --gpus[g], as
    plain DDP on one host does, so that NCCL may open its P2P (NVLink) path between the processes."""
    if args.device != "cuda" or link.capped:
        return "0"
    return args.gpus[node * args.local_ranks + local]


def nccl_transport(log_path):
    """The distinct 'via ...' transports NCCL logged (e.g. NET/Socket/0, P2P/CUMEM, NVLS)."""
    found = set()
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                if "NCCL INFO" in line:
                    m = re.search(r"\bvia (\S+)", line)
                    if m:
                        found.add(m.group(1))
    except OSError:
        pass
    return sorted(found)


def _written(path):
    try:
        with open(path) as f:
            return f.read().endswith("\n")
    except OSError:
        return False


def daemon_local_clients(log_path):
    """{"expected": N, "connected": most seen at once} from a sparsecard log ("... (2 local
    clients)", "... connected (uid 0, 2 of 2 local clients)"); None without such lines."""
    expected = connected = None
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                m = re.search(r"connected \(.*?\b(\d+) of (\d+) local clients\)", line)
                if m:
                    connected = max(connected or 0, int(m.group(1)))
                    expected = int(m.group(2))
                    continue
                m = re.search(r"listening on .*\((\d+) local clients\)", line)
                if m:
                    expected = int(m.group(1))
    except OSError:
        return None
    if expected is None and connected is None:
        return None
    return {"expected": expected, "connected": connected or 0}


def wait_trainers(job, procs, outs, timeout, exit_grace=15.0):
    """Waits for every trainer; returns (status, message). A failed or skipped rank stops the
    others at once (they would wait in a collective until NCCL's own timeout). Ranks that wrote
    their results but do not exit within exit_grace seconds are stopped, and the run counts."""
    deadline = time.monotonic() + timeout
    written_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return "ok", None
        if written_at is None and all(_written(o) for o in outs):
            written_at = time.monotonic()
        if written_at is not None and time.monotonic() - written_at > exit_grace and None in codes:
            return "ok", f"results written, but a trainer had not exited {exit_grace:.0f} s later: stopped"
        if any(c == SKIPPED for c in codes):
            return "skipped", tail(job.log_of(procs[codes.index(SKIPPED)]), 3).strip()
        bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            msg = [f"--- trainer rank {i} exited with status {codes[i]}; {job.log_of(procs[i])}:\n"
                   f"{tail(job.log_of(procs[i]))}" for i in bad]
            for r, d in enumerate(job.daemons):
                msg.append(f"--- sparsecard node {r} (status {d.poll()}); {job.log_of(d)}:\n{tail(job.log_of(d), 10)}")
            return "failed", "\n".join(msg)
        if job.daemons:
            try:
                job.check_daemons()
            except JobError as e:
                return "failed", str(e)
        if time.monotonic() > deadline:
            return "timeout", f"killed after {timeout:.0f} s (--run-timeout):\n" + "".join(
                f"--- {job.log_of(p)}:\n{tail(job.log_of(p), 10)}" for p in procs if p.poll() is None)
        time.sleep(0.05)


def run_one(args, link, model, method, trainer_args, run_dir, timeout):
    """One set of 2 x --local-ranks trainers (+ daemons for sparsecar*): returns the run's entry."""
    os.makedirs(run_dir, exist_ok=True)
    entry = {"model": model, "method": method, "rate": link.rate, "local_ranks": args.local_ranks,
             "world": NODES * args.local_ranks, "log_dir": run_dir}
    sent0 = link.sent_bytes()
    t0 = time.monotonic()
    port = MASTER_PORT if link.capped else free_port()
    # Unix socket paths must stay under 108 bytes: sockets in a short directory of /tmp, logs in run_dir.
    sock_dir = tempfile.mkdtemp(prefix="scddp-")
    try:
        with LocalJob(args.sparsecard, nodes=NODES, local_clients=args.local_ranks, workdir=run_dir,
                      keep=True) as job:
            job.sockets = [os.path.join(sock_dir, f"node-{n}.sock") for n in range(NODES)]
            try:
                if method.startswith("sparsecar"):
                    density = args.tta_density if model in FMNIST_MODELS else args.density
                    flags = daemon_flags(args, method, density)
                    entry["daemon_flags"] = flags
                    start_daemons(args, job, link, flags)
                procs, outs = [], []
                for rank, node, local in processes(args):
                    out = os.path.join(run_dir, f"trainer-{rank}.json")
                    if os.path.exists(out):
                        os.remove(out)  # an earlier run's results must never pass for this one's
                    outs.append(out)
                    trainer_method = "sparsecar" if method.startswith("sparsecar") else method
                    argv = trainer_prefix(args) + [
                        args.python, TRAINER, "--model", model, "--method", trainer_method, "--device", args.device,
                        "--out", out, "--gpu", gpu_index(args, link, node, local)] + trainer_args
                    if method.startswith("sparsecar"):
                        argv += ["--socket", job.sockets[node]]
                        if args.device_path:
                            argv += ["--device-path", args.device_path]
                        if args.agreement:
                            argv += ["--agreement", args.agreement]
                    if method in CONTROLLED:
                        argv += ["--report-compute-time"]
                    procs.append(job.spawn(f"trainer rank {rank}", link.argv(node, argv),
                                           env=trainer_env(args, job, link, node, local, port),
                                           log_name=f"trainer-{rank}"))
                status, message = wait_trainers(job, procs, outs, timeout)
            except JobError as e:
                status, message = "failed", str(e)
            entry["status"] = status
            if message:
                entry["message"] = message
            entry["nccl_transport"] = nccl_transport(os.path.join(run_dir, "trainer-0.log"))
            if method in CONTROLLED:
                entry["controller_decisions"] = decisions(os.path.join(run_dir, "sparsecard-0.log"))
                entry["start_hint"] = start_hint(os.path.join(run_dir, "sparsecard-0.log"))
            if method.startswith("sparsecar"):
                entry["daemon_local_clients"] = [daemon_local_clients(os.path.join(run_dir, f"sparsecard-{n}.log"))
                                                 for n in range(NODES)]
            killed = job.stop_all()
            if killed:
                entry["killed"] = killed
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    entry["run_seconds"] = round(time.monotonic() - t0, 2)
    sent1 = link.sent_bytes()
    if sent0 is not None and sent1 is not None:
        entry["link_bytes"] = sent1 - sent0
    if status == "ok":
        ranks = []
        for out in outs:
            with open(out) as f:
                ranks.append(json.loads(f.readline()))
        entry["ranks"] = ranks
        r0 = ranks[0]
        for k in ("params", "batch", "device_name", "backend", "torch", "compute_ms", "start_up_s", "step_ms",
                  "steps_timed", "dense_ring_bytes_per_step", "payload_bytes_per_step", "hook", "hook_path", "hook_agreement", "powersgd",
                  "final_accuracy", "train_seconds", "eval_seconds", "curve", "steps", "epochs", "test_images",
                  "dtype", "params_identical"):
            if k in r0:
                entry[k] = r0[k]
        if all(r.get("step_ms") for r in ranks):
            entry["step_ms_median_max_over_ranks"] = max(r["step_ms"]["median"] for r in ranks)
        steps = r0.get("steps") or (r0.get("steps_timed", 0) + r0.get("warmup", 0))
        if entry.get("link_bytes") is not None and steps:
            entry["link_bytes_per_step"] = entry["link_bytes"] / steps
        hook = r0.get("hook")
        if hook and hook.get("mode") != "sparse":
            entry["warning"] = f"sparsecar hook ended in mode {hook.get('mode')}: {hook.get('failure')}"
        # Every rank gathered every rank's SHA-256; check here too that all of them reported the same.
        shas = {r.get("params_sha256") for r in ranks}
        entry["params_checked_ranks"] = len(ranks)
        entry["params_identical"] = (len(ranks) == entry["world"] and len(shas) == 1 and None not in shas
                                     and all(r.get("params_identical") is True for r in ranks))
        if not entry["params_identical"]:
            entry["status"] = "failed"
            entry["message"] = (f"the {len(ranks)} ranks (of {entry['world']}) did not end with identical "
                                f"parameters (params_sha256: {sorted(str(x) for x in shas)})")
    return entry


def start_hint(log_path):
    """What rank 0's daemon got from the hook before its first step (the quickest dense iteration's
    period and its wait on the all-reduce; docs/controllers.md "The warm-up before the first
    step"), or None."""
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                m = HINT.search(line)
                if m:
                    return {"step": int(m.group(1)), "dense_step_ms": float(m.group(2)),
                            "dense_wait_ms": float(m.group(3))}
    except OSError:
        pass
    return None


# ---- reporting ----------------------------------------------------------------------------------
def add_ratios(runs):
    """Per (model, rate): every method's median step time over dense's and over PowerSGD's."""
    base = {}
    for e in runs:
        if e.get("step_ms") and e["method"] in ("dense", "powersgd") and e["model"] not in FMNIST_MODELS:
            base[(e["model"], e["rate"], e["method"])] = e["step_ms"]["median"]
    for e in runs:
        if not e.get("step_ms") or e["model"] in FMNIST_MODELS:
            continue
        for ref in ("dense", "powersgd"):
            b = base.get((e["model"], e["rate"], ref))
            e[f"ratio_to_{ref}"] = e["step_ms"]["median"] / b if b else None


def fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def topology_text(t):
    if not t:
        return ""
    plural = "s" if t["local_ranks"] > 1 else ""
    return f"{t['nodes']} nodes x {t['local_ranks']} local rank{plural} = world {t['world']}"


def print_step_table(runs, device_name, topology=None):
    rows = [e for e in runs if e["model"] not in FMNIST_MODELS]
    if not rows:
        return
    where = "; ".join(x for x in (device_name, topology_text(topology)) if x)
    print(f"\nstep time ({where}); median over timed steps, p10-p90; ratios against dense and PowerSGD "
          f"of the same rate and run")
    print(f"{'model':<9} {'rate':<7} {'method':<20} {'median ms':>10} {'p10-p90 ms':>16} {'x dense':>8} "
          f"{'x psgd':>7} {'payload MB/step':>15} {'link MB/step':>12} {'nccl via':<14} status")
    for e in rows:
        s = e.get("step_ms") or {}
        spread = f"{fmt(s.get('p10'), '.1f')}-{fmt(s.get('p90'), '.1f')}" if s else "-"
        pay = e.get("payload_bytes_per_step")
        link = e.get("link_bytes_per_step")
        print(f"{e['model']:<9} {e['rate']:<7} {e['method']:<20} {fmt(s.get('median'), '10.2f'):>10} {spread:>16} "
              f"{fmt(e.get('ratio_to_dense'), '8.3f'):>8} {fmt(e.get('ratio_to_powersgd'), '7.3f'):>7} "
              f"{fmt(pay / 1e6 if pay is not None else None, '15.3f'):>15} "
              f"{fmt(link / 1e6 if link is not None else None, '12.3f'):>12} "
              f"{','.join(e.get('nccl_transport', []))[:14]:<14} {e['status']}"
              + (f" (hook path: {e['hook_path']})" if e.get("hook_path") else "")
              + (f" ({e['warning']})" if e.get("warning") else ""))


def time_to(curve, target):
    for steps, secs, acc in curve:
        if acc >= target - 1e-9:
            return secs, steps
    return None, None


def tta_summary(runs):
    rows = [e for e in runs if e["model"] in FMNIST_MODELS and e["status"] == "ok"]
    dense = next((e for e in rows if e["method"] == "dense"), None)
    if dense is None:
        return None
    target = dense["final_accuracy"]
    dense_steps = dense.get("steps")
    out = {"target_accuracy": target, "rate": dense["rate"], "model": dense["model"],
           "dense_steps": dense_steps, "methods": {}}
    if "world" in dense:
        out.update(local_ranks=dense.get("local_ranks"), world=dense["world"])
    for e in rows:
        t, steps = time_to(e.get("curve", []), target)
        at = [acc for n, _, acc in e.get("curve", []) if dense_steps is not None and n <= dense_steps]
        out["methods"][e["method"]] = {
            "steps": e.get("steps"), "epochs": e.get("epochs"),
            "accuracy_at_dense_steps": at[-1] if at else None,
            "time_to_target_s": t, "steps_to_target": steps, "final_accuracy": e["final_accuracy"],
            "final_accuracy_minus_dense_pp": 100 * (e["final_accuracy"] - target),
            "train_seconds": e["train_seconds"], "median_step_ms": (e.get("step_ms") or {}).get("median"),
            "link_bytes": e.get("link_bytes"), "payload_bytes_per_step": e.get("payload_bytes_per_step")}
    dt = out["methods"]["dense"]["time_to_target_s"]
    for m in out["methods"].values():
        m["time_to_target_over_dense"] = (m["time_to_target_s"] / dt) if (dt and m["time_to_target_s"]) else None
    return out


def print_tta(t):
    if not t:
        return
    world = f", {topology_text(dict(t, nodes=NODES))}" if t.get("world") else ""
    print(f"\ntime to accuracy, Fashion-MNIST {t.get('model', 'fmnist_cnn')}, {t['rate']}{world}: target = "
          f"dense's final test accuracy {100 * t['target_accuracy']:.2f}% (after {t.get('dense_steps')} steps)")
    print(f"{'method':<20} {'t->target s':>11} {'x dense':>8} {'steps':>6} {'epochs':>6} {'final':>8} "
          f"{'@dense steps':>12} {'train s':>8} {'step ms':>8}")
    for m, e in t["methods"].items():
        at = e.get("accuracy_at_dense_steps")
        print(f"{m:<20} {fmt(e['time_to_target_s'], '11.1f'):>11} {fmt(e['time_to_target_over_dense'], '8.3f'):>8} "
              f"{fmt(e['steps_to_target'], '6d'):>6} {fmt(e.get('epochs'), '6.1f'):>6} "
              f"{100 * e['final_accuracy']:>7.2f}% {fmt(100 * at if at is not None else None, '11.2f'):>11}% "
              f"{e['train_seconds']:>8.1f} {fmt(e['median_step_ms'], '8.2f'):>8}")


# ---- main ---------------------------------------------------------------------------------------
def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    g = p.add_argument_group("what runs")
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    g.add_argument("--part", default="step,tta", help="step, tta or both (default step,tta)")
    g.add_argument("--models", default="mlp50,resnet18", help="step part's models (ddp_trainer.py --model)")
    g.add_argument("--rates", default="1gbit,10gbit,none", help="tc tbf rates; none = no namespaces, no cap")
    g.add_argument("--methods", default="dense,powersgd,sparsecar",
                   help="step part (sparsecar_bandwidth = the daemons with --controller bandwidth, "
                        "sparsecar_adaptive = with the controllers' default, schedule,step)")
    g.add_argument("--tta-rate", default="1gbit")
    g.add_argument("--tta-methods", default=",".join(TTA_METHODS), help="tta part; dense first (its final "
                   "accuracy is the target)")
    g.add_argument("--tta-model", choices=FMNIST_MODELS, default="fmnist_cnn",
                   help="tta part's model (ddp_trainer.py says what each is)")
    g.add_argument("--tta-epochs", type=float, default=3.0, help="tta part: dense's epochs (and the others' "
                   "unless --tta-epochs-compressed)")
    g.add_argument("--tta-epochs-compressed", type=float, default=None,
                   help="tta part: epochs of powersgd and sparsecar (default --tta-epochs)")
    g.add_argument("--tta-dense-iterations", type=int, default=0,
                   help="tta part: the sparsecar hook's dense warm-up iterations (0: the hook's default, 2)")
    g.add_argument("--tta-run-timeout", type=float, default=300.0, help="seconds one tta run may take")
    g.add_argument("--eval-every", type=int, default=50, help="tta: steps between test evaluations")
    g.add_argument("--eval-limit", type=int, default=0, help="tta: test on the first N test images only "
                   "(0 = all 10k; smoke tests on CPU)")
    g.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    g.add_argument("--quick", action="store_true", help="fewer steps: --budget-s 1.5 --min-steps 3 --warmup 3 "
                   "--tta-epochs 1 (unless given)")
    t = p.add_argument_group("trainers")
    t.add_argument("--local-ranks", type=int, default=1, metavar="N",
                   help="trainer processes (GPUs) per node: the world is 2 x N processes, each node's "
                   "sparsecard gets --local-clients N (default 1)")
    t.add_argument("--gpus", default=None, help="2 x N GPU indices, node 0's N first (default 0,...,2N-1; "
                   "e.g. N = 2: 0,1,2,3 = node 0 on 0,1 and node 1 on 2,3; one GPU for both nodes, 0,0, "
                   "with --backend gloo only)")
    t.add_argument("--python", default=sys.executable, help="interpreter with torch for the trainers")
    t.add_argument("--pythonpath", help="directory holding the sparsecar package (default <build-dir>/python)")
    t.add_argument("--backend", help="ddp_trainer.py --backend (default nccl on cuda, gloo on cpu)")
    t.add_argument("--steps", type=int, default=100, help="most timed steps per run")
    t.add_argument("--min-steps", type=int, default=None, help="fewest timed steps per run (default 5)")
    t.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="step part's parameters and activations (DDP's buckets get this type)")
    t.add_argument("--budget-s", type=float, default=None, help="timed seconds per run (default 6)")
    t.add_argument("--warmup", type=int, default=None, help="untimed iterations (default 4; >= 3)")
    t.add_argument("--batch", type=int, help="step part, per rank (default: per model)")
    t.add_argument("--tta-batch", type=int, default=128, help="tta part, per rank")
    t.add_argument("--image-size", type=int, default=224, help="resnet18's input (32 = CIFAR-sized)")
    t.add_argument("--threads", type=int, help="torch threads per trainer (cpu; default 1)")
    t.add_argument("--powersgd-rank", type=int, default=4)
    d = p.add_argument_group("sparsecar")
    d.add_argument("--bin", help="directory holding sparsecard (the carried bundle's bin/)")
    d.add_argument("--lib", help="shared libraries of --bin's programs (default: DIR/../lib of --bin when it "
                   "exists): on LD_LIBRARY_PATH of sparsecard, ip and tc, not of the trainers")
    d.add_argument("--build-dir", help="build tree (daemon/sparsecard, python/)")
    d.add_argument("--density", type=float, default=0.001, help="step part: the daemons' --density (top-k)")
    d.add_argument("--tta-density", type=float, default=0.01, help="tta part: --density (static; the bandwidth "
                   "controller's starting point)")
    d.add_argument("--selector", default="topk")
    d.add_argument("--agreement", choices=("auto", "device", "gloo"),
                   help="the hook's agreement= (auto: a gloo side group under NCCL; device: NCCL itself)")
    d.add_argument("--device-path", choices=("auto", "off", "require"), help="the hook's device_path= (auto: GPU "
                   "buffers by CUDA IPC when the daemon takes them, else host staging; off: host staging; require: "
                   "fail without); default: the hook's own")
    d.add_argument("--momentum-correction", action=argparse.BooleanOptionalAction, default=True,
                   help="sparsecar methods: the hook takes the trainers' SGD momentum over (DGC's momentum "
                   "correction; python/README.md), as the README advises for the adaptive controllers "
                   "(default: on; --no-momentum-correction: the trainers' own SGD momentum)")
    d.add_argument("--kernel-threads", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    d.add_argument("--daemon-arg", action="append", default=[], help="extra sparsecard flag (repeatable), "
                   "e.g. --daemon-arg=--density-min=0.001")
    o = p.add_argument_group("limits and output")
    o.add_argument("--run-timeout", type=float, default=None, help="seconds one run may take before it is "
                   "killed (default: 3 x --budget-s + 90; tta: 300)")
    o.add_argument("--total-budget-s", type=float, default=540.0, help="no run starts after this many seconds")
    o.add_argument("--out-dir", default="bench-gpu-ddp", help="logs of every run and the results JSON")
    o.add_argument("--out", help="results JSON (default <out-dir>/bench-gpu-ddp.json)")
    args = p.parse_args(argv)

    def default(name, normal, quick):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else normal)
    default("budget_s", 6.0, 1.5)
    default("min_steps", 5, 3)
    default("warmup", 4, 3)
    if args.quick and "--tta-epochs" not in " ".join(argv):
        args.tta_epochs = 1.0
    if args.run_timeout is None:
        args.run_timeout = 3 * args.budget_s + 90
    args.parts = [x for x in args.part.split(",") if x]
    if not set(args.parts) <= {"step", "tta"}:
        p.error("--part takes step, tta or step,tta")
    args.rate_list = [r for r in args.rates.split(",") if r]
    for rate in args.rate_list + [args.tta_rate]:
        if rate != "none":
            try:
                rate_bits(rate)
            except ValueError as e:
                p.error(str(e))
    args.model_list = [m for m in args.models.split(",") if m]
    args.method_list = [m for m in args.methods.split(",") if m]
    args.tta_list = [m for m in args.tta_methods.split(",") if m]
    for m in args.method_list + args.tta_list:
        if m not in TTA_METHODS:
            p.error(f"unknown method {m} (known: {', '.join(TTA_METHODS)})")
    if "tta" in args.parts and args.tta_list[:1] != ["dense"]:
        p.error("--tta-methods must start with dense (its final accuracy is the target)")
    if args.local_ranks < 1:
        p.error("--local-ranks must be >= 1")
    if args.gpus is None:
        args.gpus = ",".join(str(i) for i in range(NODES * args.local_ranks))
    args.gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    if len(args.gpus) != NODES * args.local_ranks:
        p.error(f"--gpus takes {NODES * args.local_ranks} indices ({NODES} nodes x --local-ranks "
                f"{args.local_ranks}), got {len(args.gpus)}")
    if len(set(args.gpus)) != len(args.gpus) and args.backend != "gloo":
        # A machine of one GPU can still run both nodes (the daemons' CUDA IPC and the hook work
        # there), but NCCL refuses two ranks on one GPU.
        p.error("--gpus lists a GPU twice: NCCL takes one rank per GPU (two trainers may share one "
                "with --backend gloo)")
    if args.bin:
        args.sparsecard = os.path.join(args.bin, "sparsecard")
        lib = os.path.join(os.path.dirname(os.path.abspath(args.bin)), "lib")
        if args.lib is None and os.path.isdir(lib):
            args.lib = lib
    elif args.build_dir:
        args.sparsecard = os.path.join(args.build_dir, "daemon", "sparsecard")
    else:
        args.sparsecard = shutil.which("sparsecard")
    if not args.pythonpath and args.build_dir:
        args.pythonpath = os.path.join(args.build_dir, "python")
    args.out = args.out or os.path.join(args.out_dir, "bench-gpu-ddp.json")
    return args


def preflight(args):
    """Every reason not to start, as one message each (empty if all is well)."""
    errors = []
    capped = any(r != "none" for r in args.rate_list) or ("tta" in args.parts and args.tta_rate != "none")
    if capped:
        if os.geteuid() != 0:
            errors.append("needs root for network namespaces and tc (or use --rates none)")
        for tool in ("ip", "tc"):
            if not shutil.which(tool):
                errors.append(f"'{tool}' not on PATH (iproute2; on the GPU machine: the bundle's bin/)")
    methods = (args.method_list if "step" in args.parts else []) + (args.tta_list if "tta" in args.parts else [])
    uses_sparsecar = any(m.startswith("sparsecar") for m in methods)
    if uses_sparsecar and (not args.sparsecard or not os.access(args.sparsecard, os.X_OK)):
        errors.append(f"sparsecard not found or not executable ({args.sparsecard or 'not on PATH'}); pass --bin "
                      f"DIR or --build-dir")
    # One interpreter start (importing torch takes seconds): torch, the GPUs, the sparsecar package.
    probe = subprocess.run(
        [args.python, "-c", "import sys, torch\n"
         "if sys.argv[1] == 'cuda' and torch.cuda.device_count() < int(sys.argv[3]): sys.exit(4)\n"
         "if sys.argv[2] == '1':\n"
         "    try:\n        import sparsecar.torch\n"
         "    except Exception as e:\n        print(repr(e), file=sys.stderr); sys.exit(5)\n",
         args.device, "1" if uses_sparsecar else "0", str(len(set(args.gpus)))],
        capture_output=True, text=True,
        env=dict(os.environ, LD_LIBRARY_PATH=args.orig_ld_library_path,
                 PYTHONPATH=os.pathsep.join(p for p in (args.pythonpath, os.environ.get("PYTHONPATH")) if p)))
    last = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else ""
    if probe.returncode == 4:
        errors.append(f"--device cuda needs {len(set(args.gpus))} GPUs visible to torch (--gpus "
                      f"{','.join(args.gpus)})")
    elif probe.returncode == 5:
        errors.append(f"{args.python} cannot import sparsecar.torch (--pythonpath {args.pythonpath}): {last}")
    elif probe.returncode != 0:
        errors.append(f"{args.python} cannot import torch: {last}")
    if "tta" in args.parts and not os.path.exists(os.path.join(args.data_dir, "t10k-labels-idx1-ubyte.gz")):
        errors.append(f"Fashion-MNIST not in {args.data_dir} (Debian: dataset-fashion-mnist; --data-dir)")
    return errors


def trainer_args(args, model, method):
    a = ["--warmup", str(args.warmup), "--powersgd-rank", str(args.powersgd_rank), "--dtype", args.dtype]
    if method.startswith("sparsecar") and args.momentum_correction:
        a += ["--momentum-correction"]
    if args.backend:
        a += ["--backend", args.backend]
    if args.threads:
        a += ["--threads", str(args.threads)]
    if model in FMNIST_MODELS:
        epochs = args.tta_epochs
        if method != "dense" and args.tta_epochs_compressed is not None:
            epochs = args.tta_epochs_compressed
        if method.startswith("sparsecar") and args.tta_dense_iterations:
            a += ["--dense-iterations", str(args.tta_dense_iterations)]
        return a + ["--batch", str(args.tta_batch), "--epochs", repr(epochs),
                    "--eval-every", str(args.eval_every), "--data-dir", args.data_dir,
                    "--eval-limit", str(args.eval_limit)]
    if args.batch:
        a += ["--batch", str(args.batch)]
    return a + ["--steps", str(args.steps), "--min-steps", str(args.min_steps), "--budget-s", repr(args.budget_s),
                "--image-size", str(args.image_size)]


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)  # unwinds through every teardown


def main(argv):
    args = parse(argv)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    args.orig_ld_library_path = os.environ.get("LD_LIBRARY_PATH", "")
    if args.lib:  # for every child of this script (sparsecard, ip, tc) except the trainers
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (os.path.abspath(args.lib), args.orig_ld_library_path) if p)
    errors = preflight(args)
    if errors:
        for e in errors:
            print(f"ddp_capped.py: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    t_start = time.monotonic()
    topology = {"nodes": NODES, "local_ranks": args.local_ranks, "world": NODES * args.local_ranks,
                "gpus": [node_gpus(args, n) for n in range(NODES)] if args.device == "cuda" else None}
    results = {"machine": machine(), "config": {k: v for k, v in vars(args).items() if k not in ("parts",)},
               "topology": topology, "links": {}, "runs": []}
    used = [g for g in results["machine"].get("gpus", []) if g.split(",")[0].strip() in args.gpus]
    device_name = "cpu" if args.device == "cpu" else ", ".join(used or results["machine"].get("gpus", [])[:2]) or "cuda"
    print(f"{topology_text(topology)} processes" + (f"; GPUs per node {topology['gpus']}" if topology["gpus"] else ""),
          flush=True)

    def save():
        add_ratios(results["runs"])
        results["time_to_accuracy"] = tta_summary(results["runs"])
        results["wall_seconds"] = round(time.monotonic() - t_start, 1)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    plan = []  # (rate, model, method)
    if "step" in args.parts:
        plan += [(r, m, meth) for r in args.rate_list for m in args.model_list for meth in args.method_list]
    if "tta" in args.parts:
        plan += [(args.tta_rate, args.tta_model, meth) for meth in args.tta_list]
    failed = 0
    by_rate = []
    for rate, model, method in plan:  # group by rate, keeping the order: one link per rate
        if not by_rate or by_rate[-1][0] != rate:
            by_rate.append((rate, []))
        by_rate[-1][1].append((model, method))
    def skip(rate, model, method, why):
        print(f"  {model} {method}: skipped ({why})")
        results["runs"].append({"model": model, "method": method, "rate": rate, "status": "skipped",
                                "message": why})

    spent = f"--total-budget-s {args.total_budget_s:.0f} s spent"
    for rate, runs in by_rate:
        if time.monotonic() - t_start > args.total_budget_s:
            for model, method in runs:
                skip(rate, model, method, spent)
            continue
        print(f"== {rate}: {', '.join(f'{m}/{meth}' for m, meth in runs)}", flush=True)
        try:
            with Link(rate) as link:
                link.check(trainer_python(args))
                results["links"][rate] = link.info
                for model, method in runs:
                    if time.monotonic() - t_start > args.total_budget_s:
                        skip(rate, model, method, spent)
                        continue
                    e = run_and_report(args, link, model, method)
                    results["runs"].append(e)
                    failed += e["status"] in ("failed", "timeout")
                    save()
        except (RuntimeError, OSError, ValueError) as err:  # the link could not be set up or checked
            print(f"ddp_capped.py: link {rate} failed: {err}", file=sys.stderr, flush=True)
            results["links"][rate] = {"rate": rate, "error": str(err)}
            done = {(e["model"], e["method"]) for e in results["runs"] if e["rate"] == rate}
            for model, method in runs:
                if (model, method) not in done:
                    results["runs"].append({"model": model, "method": method, "rate": rate, "status": "failed",
                                            "message": f"link {rate}: {err}"})
                    failed += 1
    save()
    print_step_table(results["runs"], device_name, topology)
    print_tta(results["time_to_accuracy"])
    print(f"\nwrote {os.path.abspath(args.out)} ({results['wall_seconds']:.0f} s); logs under "
          f"{os.path.abspath(args.out_dir)}")
    return 1 if failed else 0


def run_and_report(args, link, model, method):
    run_dir = os.path.join(os.path.abspath(args.out_dir), f"{link.rate}-{model}-{method}")
    timeout = args.tta_run_timeout if model in FMNIST_MODELS else args.run_timeout
    e = run_one(args, link, model, method, trainer_args(args, model, method), run_dir, timeout)
    s = e.get("step_ms") or {}
    extra = (f", final accuracy {100 * e['final_accuracy']:.2f}% in {e['train_seconds']:.1f} s"
             if "final_accuracy" in e else "")
    same = {True: f", parameters identical on all {e.get('params_checked_ranks')} ranks",
            False: ", PARAMETERS DIFFER"}.get(e.get("params_identical"), "")
    clients = e.get("daemon_local_clients")
    if clients and all(clients):
        same += ", daemons' local clients " + "/".join(f"{c['connected']} of {c['expected']}" for c in clients)
    print(f"  {model} {method}: {e['status']}, median {fmt(s.get('median'), '.2f')} ms "
          f"({e['run_seconds']:.0f} s){extra}{same}", flush=True)
    if e["status"] in ("failed", "timeout"):
        print(f"  {e.get('message', '')}", file=sys.stderr, flush=True)
    elif e["status"] == "skipped":
        print(f"  ({e.get('message', '')})")
    if e.get("warning"):
        print(f"  WARNING: {e['warning']}", flush=True)
    if e.get("start_hint"):
        h = e["start_hint"]
        print(f"  the hook's dense step: {h['dense_step_ms']:.3g} ms, {h['dense_wait_ms']:.3g} ms of it waiting "
              f"on the all-reduce", flush=True)
    hook = e.get("hook") or {}
    if hook.get("trainer_reduced_buckets"):
        print(f"  buckets the trainers reduced (dense_collective=trainer): {hook['trainer_reduced_buckets']}", flush=True)
    for d in e.get("controller_decisions") or []:
        print(f"  decision: {d}", flush=True)
    return e


def _main(argv):
    try:
        return main(argv)
    except KeyboardInterrupt as e:  # SIGTERM/SIGINT/SIGHUP: the with-blocks tore everything down
        print(f"ddp_capped.py: stopped by {e or 'SIGINT'}; processes and namespaces removed, results so far "
              f"in the results JSON", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
