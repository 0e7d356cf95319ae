#!/usr/bin/python3
"""A real DDP job through sparsecar daemons: an MLP on scikit-learn's digits (or, with --dataset
fmnist, on Fashion-MNIST from Debian's dataset-fashion-mnist), 2 nodes x 2 local
ranks (4 trainer processes, 2 sparsecard daemons on loopback, --local-clients 2), gloo for the
process group. The same trainer processes train the same model (same initialisation, same
batches) three times, one after the other:

  dense      DDP's plain all-reduce (a counting copy of torch's allreduce hook)
  powersgd   torch's PowerSGD hook (rank --powersgd-rank, dense for the first 2 iterations)
  sparsecar  sparsecar.torch.register (dense for the first 2 iterations, then the daemons)

and reports final test accuracy, bytes sent and wall time of each.

Bytes are counted the same way for every method: every all-reduce of n float32 elements that a
method issues costs what sparsecard's dense ring all-reduce between the W nodes sends,
2(W-1) messages of (72-byte header + 4n/W bytes) per node (the daemon's own `dense_bytes`
formula), summed over the nodes. So dense, PowerSGD's P/Q/uncompressed all-reduces and
sparsecar's dense warm-up iterations are all priced as node-level ring all-reduces; sparsecar's
compressed steps are what its daemons report they put on the wire (headers included). Traffic
between the local ranks of a node is not counted for any method.

Usage:  ddp_digits.py --sparsecard build/daemon/sparsecard --pythonpath build/python --out r.json
(the trainers run as `ddp_digits.py --trainer ...`, started by this script).
"""

import argparse
import hashlib
import json
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

HEADER_BYTES = 72  # sparsecar wire header (daemon/transport/WIRE.md)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "gpu"))
from ddp_trainer import FMNIST_DIR, FMNIST_MEAN, FMNIST_STD, load_fmnist  # noqa: E402  (stdlib only at import)


def ring_bytes_per_node(calls, elements, nodes):
    """What sparsecard's ring all-reduce sends per node for `calls` all-reduces totalling
    `elements` float32 elements (exact for 2 nodes; chunk rounding ignored otherwise)."""
    if nodes <= 1:
        return 0
    return 2 * (nodes - 1) * HEADER_BYTES * calls + 2 * (nodes - 1) * 4 * elements / nodes


def load_digits_arrays(path=None):
    """scikit-learn's digits (x float64 [1797, 64], y int64), from `path` (an .npz that
    save_digits wrote) when given, else from scikit-learn itself. The trainers read the launcher's
    copy: importing sklearn (and scipy) costs each trainer process about 2 s of CPU, per job."""
    import numpy as np
    if path:
        with np.load(path) as f:
            return f["x"], f["y"]
    from sklearn.datasets import load_digits
    return load_digits(return_X_y=True)


def save_digits(path):
    """Writes the digits once for every trainer of a run (the same arrays, bit for bit)."""
    import numpy as np
    x, y = load_digits_arrays()
    np.savez(path, x=x, y=y)
    return path


def make_mlp(torch, features, hidden, seed):
    """The jobs' model, seeded: features -> hidden -> hidden -> 10 with ReLUs (every trainer builds
    the same one; bench/controllers/dense_worth.py trains it too)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def load_shard(args, rank, world, np):
    """((train x, y) of this rank's shard, (test x, y)): x float32 [n, features], y int64. digits:
    a seeded quarter of the 1797 images is the test set, the rest is sharded over the ranks;
    fmnist: the 60,000 training images (seeded order) sharded, the first --test-limit test images."""
    if args.dataset == "fmnist":
        tx, ty, vx, vy = load_fmnist(args.data_dir, np)

        def prepare(images, labels):
            x = (images.reshape(len(images), -1).astype(np.float32) / 255.0 - FMNIST_MEAN) / FMNIST_STD
            return x.astype(np.float32), labels.astype(np.int64)
        shard = np.random.default_rng(args.seed).permutation(len(ty))[rank::world]
        n_test = args.test_limit or len(vy)
        return prepare(tx[shard], ty[shard]), prepare(vx[:n_test], vy[:n_test])
    x, y = load_digits_arrays(args.digits)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int64)
    perm = np.random.default_rng(args.seed).permutation(len(y))
    n_test = len(y) // 4
    test_idx, train_idx = perm[:n_test], perm[n_test:]
    shard = train_idx[rank::world]
    return (x[shard], y[shard]), (x[test_idx], y[test_idx])


# ---------------------------------------------------------------------------------------------
# trainer side
# ---------------------------------------------------------------------------------------------
def _sched_now():
    """(on-CPU ns, ns runnable but waiting for a CPU, involuntary context switches) of this
    thread so far, from /proc (Linux); None where it cannot be read."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            on_cpu, delay, _ = (int(x) for x in f.read().split())
        with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
            invol = next(int(line.split()[1]) for line in f if line.startswith("nonvoluntary_ctxt_switches"))
        return on_cpu, delay, invol
    except (OSError, ValueError, StopIteration):
        return None


def _compute_parts(parts, sched0, sched1, steps):
    """The parts of --report-compute-time's compute (medians over the steps, s) and, from
    /proc, what the training thread ran and waited for a CPU per step over the loop (s): where a
    setting's trainers compute slower, a longer wait for a CPU says another thread took their
    CPU; the same wait with slower parts says the CPU ran them slower (caches, clock)."""
    def median(v):
        v = sorted(v)
        return v[len(v) // 2] if v else None
    out = {name: median([p[i] for p in parts]) for i, name in enumerate(("forward", "backward", "optimizer"))}
    if sched0 is not None and sched1 is not None and steps:
        out["on_cpu_per_step"] = (sched1[0] - sched0[0]) / 1e9 / steps
        out["cpu_wait_per_step"] = (sched1[1] - sched0[1]) / 1e9 / steps
        out["involuntary_switches_per_step"] = (sched1[2] - sched0[2]) / steps
    return out


def trainer(args):
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)

    (xs, ys), (xt, yt) = load_shard(args, rank, world, np)
    xs, ys, xt, yt = (torch.from_numpy(a) for a in (xs, ys, xt, yt))

    def make_model():
        return make_mlp(torch, xs.shape[1], args.hidden, args.seed)

    def batches():
        g = np.random.default_rng(args.seed * 1000 + rank)
        while True:
            order = g.permutation(len(ys))
            for i in range(0, len(order) - args.batch + 1, args.batch):
                yield order[i:i + args.batch]

    results = {"rank": rank, "local_rank": local_rank, "node": rank // args.local_clients}
    finals = {}
    for method in args.methods.split(","):
        model = DDP(make_model())
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        calls = {"n": 0, "elements": 0}
        hook_state = None
        if method == "dense":
            def counting_allreduce(state, bucket):
                buf = bucket.buffer()
                state["n"] += 1
                state["elements"] += buf.numel()
                fut = dist.all_reduce(buf, async_op=True).get_future()
                return fut.then(lambda f: f.value()[0].div_(world))
            model.register_comm_hook(calls, counting_allreduce)
        elif method == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
            proxy = _CountingDist(dist, calls)
            powerSGD_hook.dist = proxy
            default_hooks.dist = proxy
            ps = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                             start_powerSGD_iter=2, min_compression_rate=2,
                                             random_seed=args.seed)
            model.register_comm_hook(ps, powerSGD_hook.powerSGD_hook)
        elif method == "sparsecar":
            import sparsecar.torch
            hook_state = sparsecar.torch.register(model, socket=args.socket, optimizer=opt,
                                                  on_error=args.on_error, timeout=args.step_timeout,
                                                  tensors=args.hook_tensors, announce=None,
                                                  agreement=args.agreement,
                                                  momentum_correction=args.momentum_correction)
        else:
            raise SystemExit(f"unknown method {method}")

        losses = []
        curve = []         # --eval-every: [steps done, training seconds so far, test accuracy]
        eval_s = 0.0       # time spent evaluating, kept out of the training clock
        compute = []       # --report-compute-time: this rank's compute seconds per step
        parts = []         # and its parts: [forward, backward to the first layer's gradient, optimizer] (s)
        grad_ready = [0.0]
        timing = None
        if args.report_compute_time:
            # The first layer's weight gradient is the last one backward computes: its tensor hook
            # fires right before DDP's bucket is ready, i.e. where communication starts.
            first = next(mod for mod in model.module if isinstance(mod, torch.nn.Linear))
            timing = first.weight.register_hook(lambda g: grad_ready.__setitem__(0, time.monotonic()))
        it = batches()
        dist.barrier()
        t0 = time.monotonic()
        sched0 = _sched_now() if timing is not None else None
        progress = _Progress(args.progress, t0) if args.progress and rank == 0 else None
        for step in range(args.steps):
            ts = time.monotonic()
            idx = next(it)
            opt.zero_grad(set_to_none=True)
            out = model(xs[idx])
            tf = time.monotonic()
            loss = torch.nn.functional.cross_entropy(out, ys[idx])
            loss.backward()
            tb = time.monotonic()
            opt.step()
            if timing is not None:
                to = time.monotonic() - tb
                c = (grad_ready[0] - ts) + to
                compute.append(c)
                parts.append((tf - ts, grad_ready[0] - tf, to))
                if hook_state is not None:
                    hook_state.report_metric("compute_time", c)
            if hook_state is not None:
                hook_state.report_metric("loss", loss.item())
            if step % 10 == 0 or step == args.steps - 1:
                losses.append([step, float(loss.item())])
            if progress is not None:
                progress.step(step + 1)
            if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
                te = time.monotonic()
                with torch.no_grad():
                    a = float((model.module(xt).argmax(1) == yt).float().mean())
                curve.append([step + 1, te - t0 - eval_s, a])
                eval_s += time.monotonic() - te
                if progress is not None:
                    progress.eval(curve[-1])
        if progress is not None:
            progress.close()
        sched1 = _sched_now() if sched0 is not None else None
        dist.barrier()
        wall = time.monotonic() - t0 - eval_s
        if timing is not None:
            timing.remove()
        with torch.no_grad():
            acc = float((model(xt).argmax(1) == yt).float().mean())
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        finals[method] = flat
        entry = {"accuracy": acc, "wall_seconds": wall, "losses": losses,
                 "allreduce_calls": calls["n"], "allreduce_elements": calls["elements"],
                 "param_checksum": float(flat.double().sum()),
                 "param_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}
        if curve:
            entry["curve"] = curve
        if compute:
            cs = sorted(compute)
            entry["compute_seconds"] = {"mean": sum(cs) / len(cs), "median": cs[len(cs) // 2]}
            entry["compute_parts"] = _compute_parts(parts, sched0, sched1, len(compute))
        if hook_state is not None:
            entry["hook"] = {k: int(v) for k, v in hook_state.stats.items()}
            entry["hook_mode"] = hook_state.mode
            entry["hook_failure"] = hook_state.failure
            entry["hook_dense_timing"] = hook_state.dense_timing  # (step s, wait s) reported to the daemon
            summary = hook_state.summary()
            entry["hook_dense_timings"] = list(zip(summary["dense_steps_s"], summary["dense_waits_s"]))
            entry["hook_compute_s"] = summary["compute_s"]  # the hook's timing of this trainer
            hook_state.close()
        if method == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
            powerSGD_hook.dist = dist
            default_hooks.dist = dist
        results[method] = entry
    if "dense" in finals:
        for m, flat in finals.items():
            if m != "dense":
                results[m]["max_abs_diff_vs_dense"] = float((flat - finals["dense"]).abs().max())
    with open(args.out, "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


class _Progress:
    """--progress FILE (rank 0): one JSON line as training starts ({"t0": time.monotonic()}), one per
    step ({"s": steps done, "t": wall seconds since t0, evaluations included}) and one per
    evaluation ({"s", "train_s", "acc"}: the curve's point), flushed as written, so a launcher can
    start a rate profile at the first step and still read the curve of a job it had to stop."""

    def __init__(self, path, t0):
        self._f = open(path, "w")
        self._t0 = t0
        self._f.write(json.dumps({"t0": t0}) + "\n")
        self._f.flush()

    def step(self, steps):
        self._f.write(f'{{"s": {steps}, "t": {time.monotonic() - self._t0:.6f}}}\n')
        self._f.flush()

    def eval(self, point):
        self._f.write(json.dumps({"s": point[0], "train_s": point[1], "acc": point[2]}) + "\n")
        self._f.flush()

    def close(self):
        self._f.close()


class _CountingDist:
    """torch.distributed with all_reduce counted (elements per call) — for PowerSGD's bytes."""

    def __init__(self, real, calls):
        self._real, self._calls = real, calls

    def __getattr__(self, name):
        return getattr(self._real, name)

    def all_reduce(self, tensor, *a, **k):
        self._calls["n"] += 1
        self._calls["elements"] += tensor.numel()
        return self._real.all_reduce(tensor, *a, **k)


# ---------------------------------------------------------------------------------------------
# launcher side
# ---------------------------------------------------------------------------------------------
def run(args):
    """Starts the daemons and the trainers; returns the summary dict."""
    from localjob import LocalJob
    nodes, L = args.nodes, args.local_clients
    world = nodes * L
    daemon_args = ["--compression", args.compression, "--selector", args.selector,
                   "--density", repr(args.density), "--threshold", repr(args.threshold),
                   "--step-timeout-ms", str(int(args.daemon_step_timeout * 1000))] + args.daemon_arg
    with LocalJob(args.sparsecard, nodes=nodes, local_clients=L, daemon_args=daemon_args,
                  keep=args.keep_logs) as job:
        if "sparsecar" in args.methods.split(","):
            job.start_daemons()
        if args.dataset == "digits" and not args.digits:  # one copy of the data for every trainer of every job
            args.digits = save_digits(os.path.join(job.dir, "digits.npz"))
        # --jobs N: N DDP jobs one after another on the same (long-lived) daemons.
        runs = [summarize(args, *_run_trainers(args, job, world, L, j)) for j in range(args.jobs)]
        if args.keep_logs:
            print(f"logs kept in {job.dir}", file=sys.stderr)
    s = runs[-1]
    if args.jobs > 1:
        s["jobs"] = [{m: {k: e.get(k) for k in ("rank_checksum_spread", "ranks_identical", "hook_mode",
                                                 "hook_failure", "accuracy")} | {"hook": e.get("hook")}
                      for m, e in r["methods"].items()} for r in runs]
    return s


def _run_trainers(args, job, world, L, job_index):
    """One DDP job of `world` trainer processes; returns (per-rank results, wall seconds)."""
    from localjob import free_port
    port = free_port()
    procs, outs = [], []
    for rank in range(world):
        node, local = divmod(rank, L)
        env = job.daemon_env()
        env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                    "LOCAL_WORLD_SIZE": str(L), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
        if args.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join([args.pythonpath] + [p for p in [env.get("PYTHONPATH")] if p])
        out = os.path.join(job.dir, f"trainer-{job_index}-{rank}.json")
        outs.append(out)
        argv = [sys.executable, os.path.abspath(__file__), "--trainer", "--out", out,
                "--socket", job.sockets[node]] + _forward(args)
        procs.append(job.spawn(f"job {job_index} trainer rank {rank}", argv, env=env,
                               log_name=f"trainer-{job_index}-{rank}"))
    t0 = time.monotonic()
    job.wait_all(procs, timeout=args.timeout)
    total_wall = time.monotonic() - t0
    ranks = []
    for out in outs:
        with open(out) as f:
            ranks.append(json.load(f))
    return ranks, total_wall


def _forward(args):
    keys = ["methods", "steps", "batch", "lr", "momentum", "hidden", "seed", "powersgd_rank",
            "local_clients", "on_error", "step_timeout", "eval_every", "hook_tensors", "agreement", "dataset",
            "data_dir", "test_limit"]
    out = []
    for k in keys:
        out += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    if args.digits:
        out += ["--digits", args.digits]
    if args.report_compute_time:
        out.append("--report-compute-time")
    if args.momentum_correction:
        out.append("--momentum-correction")
    if args.progress:  # written by trainer rank 0 only
        out += ["--progress", os.path.abspath(args.progress)]
    return out


def summarize(args, ranks, total_wall):
    nodes = args.nodes
    s = {"dataset": args.dataset, "nodes": nodes, "local_clients": args.local_clients, "steps": args.steps,
         "batch": args.batch,
         "lr": args.lr, "momentum": args.momentum, "hidden": args.hidden, "seed": args.seed,
         "compression": args.compression, "selector": args.selector, "density": args.density,
         "threshold": args.threshold, "powersgd_rank": args.powersgd_rank, "total_wall_seconds": total_wall,
         "methods": {}}
    r0 = ranks[0]
    for m in args.methods.split(","):
        e = r0[m]
        spread = max(abs(r[m]["param_checksum"] - e["param_checksum"]) for r in ranks)
        identical = all(r[m]["param_sha256"] == e["param_sha256"] for r in ranks)
        if m in ("dense", "powersgd"):
            total = nodes * ring_bytes_per_node(e["allreduce_calls"], e["allreduce_elements"], nodes)
            detail = {"allreduce_calls": e["allreduce_calls"], "allreduce_elements": e["allreduce_elements"]}
        else:
            heads = [r for r in ranks if r["local_rank"] == 0]  # one per node: its daemon's bytes
            hook = e["hook"]
            warm = nodes * ring_bytes_per_node(hook.get("dense_buckets", 0), hook.get("dense_elements", 0), nodes)
            wire = sum(r[m]["hook"].get("sparsecar_bytes", 0) for r in heads)
            total = warm + wire
            detail = {"daemon_wire_bytes": wire, "dense_warmup_bytes": warm, "hook": hook,
                      "hook_mode": e["hook_mode"], "hook_failure": e["hook_failure"],
                      "hook_dense_timing": e.get("hook_dense_timing"),
                      "hook_dense_timings": e.get("hook_dense_timings"), "hook_compute_s": e.get("hook_compute_s"),
                      "density_measured": (hook.get("sparsecar_nnz", 0) / hook["sparsecar_elements"])
                      if hook.get("sparsecar_elements") else None}
        s["methods"][m] = dict(accuracy=e["accuracy"], bytes=int(total), wall_seconds=e["wall_seconds"],
                               rank_checksum_spread=spread, ranks_identical=identical, losses=e["losses"],
                               **detail)
        if "max_abs_diff_vs_dense" in e:
            s["methods"][m]["max_abs_diff_vs_dense"] = e["max_abs_diff_vs_dense"]
        for k in ("curve", "compute_seconds", "compute_parts"):  # --eval-every / --report-compute-time (rank 0's)
            if k in e:
                s["methods"][m][k] = e[k]
    return s


def print_summary(s):
    dense = s["methods"].get("dense")
    print(f"\nDDP {s['dataset']} MLP: {s['nodes']} nodes x {s['local_clients']} ranks, {s['steps']} steps")
    print(f"  {'method':<10} {'test acc':>9} {'bytes':>12} {'vs dense':>9} {'wall s':>8}")
    for m, e in s["methods"].items():
        ratio = f"{dense['bytes'] / e['bytes']:.1f}x" if dense and e["bytes"] else "-"
        print(f"  {m:<10} {100 * e['accuracy']:>8.2f}% {e['bytes']:>12} {ratio:>9} {e['wall_seconds']:>8.2f}")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dataset", default="digits", choices=("digits", "fmnist"),
                   help="digits: scikit-learn's 8x8 digits (1797 images, a quarter held out); fmnist: Fashion-MNIST "
                        "(60,000 training and 10,000 test images of 28x28, from --data-dir)")
    p.add_argument("--data-dir", default=FMNIST_DIR, help="fmnist: the directory of the IDX .gz files")
    p.add_argument("--test-limit", type=int, default=0,
                   help="fmnist: evaluate on the first N test images (0 = all 10,000; every rank evaluates)")
    p.add_argument("--digits", help="the digits as an .npz of x and y (default: the launcher writes one from "
                                    "scikit-learn for its trainers; a trainer without it loads scikit-learn's)")
    p.add_argument("--socket", help=argparse.SUPPRESS)
    p.add_argument("--sparsecard", help="path of the sparsecard binary")
    p.add_argument("--pythonpath", help="directory holding the sparsecar package (e.g. build/python)")
    p.add_argument("--out", help="summary JSON (launcher) / per-rank JSON (trainer)")
    p.add_argument("--methods", default="dense,powersgd,sparsecar")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local-clients", type=int, default=2)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--powersgd-rank", type=int, default=2)
    p.add_argument("--compression", default="on")
    p.add_argument("--selector", default="topk")
    p.add_argument("--density", type=float, default=0.005)
    p.add_argument("--threshold", type=float, default=0.001)
    p.add_argument("--hook-tensors", default="buckets", choices=("parameters", "buckets"),
                   help="the hook's tensors: one flat tensor per DDP bucket (default, the layout of the DDP "
                        "numbers in docs/convergence.md) or one per parameter")
    p.add_argument("--momentum-correction", action="store_true",
                   help="the hook's momentum_correction=True: it takes --momentum over from the trainer's SGD "
                        "(sparsecar method only)")
    p.add_argument("--on-error", default="raise", help="the hook's on_error (raise: a benchmark must not fall back silently)")
    p.add_argument("--agreement", default="auto", choices=("auto", "device", "gloo"),
                   help="the hook's agreement= (gloo: a gloo side group, as a NCCL job gets by default)")
    p.add_argument("--step-timeout", type=float, default=60.0, help="hook wait per bucket (s)")
    p.add_argument("--daemon-step-timeout", type=float, default=20.0)
    p.add_argument("--daemon-arg", action="append", default=[],
                   help="one more sparsecard argument (repeatable), e.g. --daemon-arg=--controller --daemon-arg=schedule")
    p.add_argument("--timeout", type=float, default=600.0, help="whole job (s)")
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--jobs", type=int, default=1,
                   help="run this many DDP jobs one after another on the same daemons")
    p.add_argument("--eval-every", type=int, default=0,
                   help="test accuracy every N steps into a curve (evaluation time kept out of the clock)")
    p.add_argument("--report-compute-time", action="store_true",
                   help="report each step's compute time to the daemon (metric compute_time, seconds)")
    p.add_argument("--progress", help="trainer rank 0: per-step wall times and the curve as JSON lines, "
                   "written as training goes (bench/controllers/real.py reads them)")
    return p.parse_args(argv)


def main(argv):
    args = parse(argv)
    if args.trainer:
        trainer(args)
        return 0
    if not args.sparsecard:
        raise SystemExit("--sparsecard is required")
    s = run(args)
    print_summary(s)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(s, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
