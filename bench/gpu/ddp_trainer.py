#!/usr/bin/env python3
"""One DDP process of bench/gpu/ddp_capped.py: trains one model with one gradient exchange and
prints one JSON line of what it measured (also written to --out).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
      python3 bench/gpu/ddp_trainer.py --model mlp50 --method powersgd --device cuda

Models (synthetic input unless fmnist_*; only step time matters for them):
  mlp50       3 x Linear(4096, 4096) + ReLU + Linear(4096, 10): 50,384,906 parameters, batch 256
  resnet18    torchvision's ResNet-18 (1000 classes, 11.7 M parameters), batch 64 of 3 x S x S
              (--image-size, default 224); skipped with a message when torchvision is missing
  tiny        Linear(256, 256) + Linear(256, 128) + Linear(128, 10): 99,978 parameters, batch 32
              (the CPU integration test)
  fmnist_cnn  a small ResNet-style CNN (308,074 parameters) on Fashion-MNIST (real data, --data-dir):
              time to accuracy, batch 128
  fmnist_resnet  a wider one (64/128/256 channels, 4 residual blocks, 2,407,114 parameters) on
              Fashion-MNIST: the same time-to-accuracy run on a model whose all-reduce, not its
              compute, dominates a step at 1 Gbit/s
Methods: dense (DDP's own all-reduce), powersgd (torch's PowerSGD hook, rank --powersgd-rank,
compressed from iteration --powersgd-start on), sparsecar (sparsecar.torch.register with the
daemon at --socket).

Step time: wall time of one whole iteration (zero_grad, forward, backward with DDP's exchange,
optimizer step), on GPUs up to torch.cuda.synchronize() at the end of the step. The first
--warmup iterations are not counted (sparsecar's hook runs its first 2 dense and registers at
the 2nd; PowerSGD starts at --powersgd-start; cuDNN and NCCL set up). After the warm-up every
rank agrees (one MAX all-reduce, outside the clock) on how many steps fit in --budget-s, between
--min-steps and --steps. Reported: median, p10, p90 and mean in ms over the timed steps.

Bytes: dense_ring_bytes_per_step = 2(W-1)/W x parameter bytes, what a ring all-reduce sends per
rank. For sparsecar, payload_bytes_per_step = the hook summary's bytes_sent / its sparse and leased iterations:
the encoded payload this node's daemon sent, i.e. the bytes that cross PCIe per step once the
buckets are registered as device tensors (payload only, no dense copy) — issue 13's "PCIe bytes
per step". That holds on the hook's device path; hook_path is the summary's "path": "device"
(GPU buffers by CUDA IPC), "host" (CUDA buckets staged through host memory: then 2 x the bucket
bytes cross PCIe as well), null from a hook too old to say.

Time to accuracy (fmnist_cnn, fmnist_resnet): --epochs over each rank's shard of the 60k training images,
test accuracy on the 10k test images every --eval-every steps and at the end; evaluation (and
the barrier after it) is kept out of the training clock. curve = [[steps, train_s, accuracy]].

On gloo (--device cpu), PowerSGD failed here with a model of two DDP buckets (fmnist_cnn: gloo
"op.preamble.length <= op.nbytes"), likely because its chained all-reduces are issued from gloo's
completion threads in a different order on each rank; one bucket (tiny) runs. NCCL issues them in
order.

Runs under Debian's /usr/bin/python3 with torch 1.13 (CPU, gloo) and Python 3.12 with torch
2.11 (CUDA, NCCL). Rank and world from --rank/--world or RANK/WORLD_SIZE (global: with several
local ranks per node, ddp_capped.py sets RANK = node x local ranks + local); rendezvous through
MASTER_ADDR/MASTER_PORT. The JSON records local_rank and node (LOCAL_RANK, SPARSECAR_NODE_RANK);
the Fashion-MNIST models shard the training set over all world ranks.
"""

import argparse
import gzip
import json
import os
import statistics
import sys
import time

MODELS = ("mlp50", "resnet18", "tiny", "fmnist_cnn", "fmnist_resnet")
FMNIST_MODELS = ("fmnist_cnn", "fmnist_resnet")  # real data, time to accuracy
METHODS = ("dense", "powersgd", "sparsecar")
DEFAULT_BATCH = {"mlp50": 256, "resnet18": 64, "tiny": 32, "fmnist_cnn": 128, "fmnist_resnet": 128}
SKIPPED = 3  # exit status: this configuration cannot run here (e.g. no torchvision)
T_START = time.perf_counter()  # start_up_s: interpreter start to the first step (imports, CUDA, NCCL)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, required=True)
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--gpu", type=int, default=0, help="CUDA device index (under a cap the orchestrator "
                   "sets CUDA_VISIBLE_DEVICES to one GPU, so 0)")
    p.add_argument("--backend", help="process group backend (default: nccl on cuda, gloo on cpu; e.g. "
                   "'cpu:gloo,cuda:nccl')")
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--world", type=int, default=None)
    p.add_argument("--steps", type=int, default=100, help="most timed steps (step-time mode)")
    p.add_argument("--min-steps", type=int, default=5, help="fewest timed steps (step-time mode)")
    p.add_argument("--budget-s", type=float, default=8.0, help="seconds the timed steps may take (estimated "
                   "from the last warm-up step)")
    p.add_argument("--warmup", type=int, default=5, help="iterations not timed (>= 3 for sparsecar)")
    p.add_argument("--batch", type=int, default=None, help="per rank (default: per model)")
    p.add_argument("--image-size", type=int, default=224, help="resnet18's input size (32 = CIFAR-sized)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--powersgd-start", type=int, default=2, help="PowerSGD's start_powerSGD_iter (>= 2)")
    p.add_argument("--socket", help="sparsecar: the node's sparsecard socket")
    p.add_argument("--device-path", choices=("auto", "off", "require"), help="sparsecar: the hook's device_path= "
                   "(CUDA buckets as GPU buffers by CUDA IPC, or staged through host memory); default: the hook's")
    p.add_argument("--hook-timeout", type=float, default=60.0, help="sparsecar: seconds per bucket")
    p.add_argument("--agreement", choices=("auto", "device", "gloo"),
                   help="sparsecar: the hook's agreement= (default: the hook's, auto)")
    p.add_argument("--dense-iterations", type=int, default=0,
                   help="sparsecar: the hook's dense_iterations= (plain all-reduce warm-up; 0: the hook's default)")
    p.add_argument("--momentum-correction", action="store_true", help="sparsecar: the hook takes the SGD "
                   "momentum over (register(..., momentum_correction=True): DGC's momentum correction)")
    p.add_argument("--report-compute-time", action="store_true", help="sparsecar: report the compute time "
                   "per step (measured before training, no exchange) as metric compute_time: the "
                   "bandwidth controller's budget")
    p.add_argument("--data-dir", default=FMNIST_DIR, help="fmnist_*: the IDX .gz files")
    p.add_argument("--epochs", type=float, default=3.0, help="fmnist_*: passes over the training set")
    p.add_argument("--eval-every", type=int, default=50, help="fmnist_*: steps between evaluations")
    p.add_argument("--eval-limit", type=int, default=0, help="fmnist_*: evaluate on the first N test images "
                   "only (0 = all 10k; for smoke tests on CPU)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="parameters and activations (step-time models): DDP's buckets then have this type")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", help="also write the JSON line here")
    args = p.parse_args(argv)
    args.rank = args.rank if args.rank is not None else int(os.environ.get("RANK", "0"))
    args.world = args.world if args.world is not None else int(os.environ.get("WORLD_SIZE", "1"))
    args.batch = args.batch or DEFAULT_BATCH[args.model]
    if args.method == "sparsecar" and not args.socket:
        p.error("--method sparsecar needs --socket")
    if args.warmup < 3 and args.model not in FMNIST_MODELS:
        p.error("--warmup must be >= 3 (sparsecar's hook is dense for 2 iterations; PowerSGD from 2)")
    return args


# ---- models -------------------------------------------------------------------------------------
def build_model(name, torch, image_size):
    nn = torch.nn
    if name == "mlp50":
        layers = []
        for _ in range(3):
            layers += [nn.Linear(4096, 4096), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(4096, 10))
    if name == "tiny":
        return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    if name == "resnet18":
        import torchvision  # the caller turns ImportError into a skip
        return torchvision.models.resnet18(num_classes=1000)
    if name == "fmnist_cnn":
        return _fmnist_cnn(torch, (32, 64, 128), extra_last=False)
    if name == "fmnist_resnet":
        return _fmnist_cnn(torch, (64, 128, 256), extra_last=True)
    raise ValueError(name)


def _fmnist_cnn(torch, widths, extra_last):
    """Stem conv, three stages of one residual block each (`widths` channels; stride 2 between
    stages; `extra_last`: a second block in the last stage), global average pool, linear head:
    308,074 parameters for (32, 64, 128), 2,407,114 for (64, 128, 256) with the extra block."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.short = None
            if stride != 1 or cin != cout:
                self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = torch.relu(self.b1(self.c1(x)))
            y = self.b2(self.c2(y))
            return torch.relu(y + (x if self.short is None else self.short(x)))

    a, b, c = widths
    blocks = [Block(a, a, 1), Block(a, b, 2), Block(b, c, 2)] + ([Block(c, c, 1)] if extra_last else [])
    return nn.Sequential(nn.Conv2d(1, a, 3, 1, 1, bias=False), nn.BatchNorm2d(a), nn.ReLU(), *blocks,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))


def synthetic_batch(name, torch, batch, image_size, device, seed):
    g = torch.Generator().manual_seed(seed)
    if name == "mlp50":
        x = torch.randn(batch, 4096, generator=g)
    elif name == "tiny":
        x = torch.randn(batch, 256, generator=g)
    else:
        x = torch.randn(batch, 3, image_size, image_size, generator=g)
    classes = 1000 if name == "resnet18" else 10
    y = torch.randint(0, classes, (batch,), generator=g)
    return x.to(device), y.to(device)


FMNIST_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist
FMNIST_MEAN, FMNIST_STD = 0.2860, 0.3530  # Fashion-MNIST's training-set pixel statistics


def load_fmnist(data_dir, np):
    """(train_x, train_y, test_x, test_y) as numpy arrays, images uint8 [n, 28, 28]."""
    def idx(name):
        path = os.path.join(data_dir, name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} missing (Debian: apt-get install dataset-fashion-mnist; on the GPU "
                                    f"machine pass the carried copy with --data-dir)")
        with gzip.open(path, "rb") as f:
            raw = f.read()
        ndim = raw[3]
        dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
        return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)
    return (idx("train-images-idx3-ubyte.gz"), idx("train-labels-idx1-ubyte.gz"),
            idx("t10k-images-idx3-ubyte.gz"), idx("t10k-labels-idx1-ubyte.gz"))


# ---- measuring ----------------------------------------------------------------------------------
def percentile(sorted_values, q):
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def stats_ms(seconds):
    s = sorted(x * 1e3 for x in seconds)
    if not s:
        return None
    return {"median": statistics.median(s), "p10": percentile(s, 0.1), "p90": percentile(s, 0.9),
            "mean": sum(s) / len(s), "n": len(s)}


def _env_int(name):
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def main(argv):
    args = parse(argv)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"rank": args.rank, "world": args.world, "local_rank": _env_int("LOCAL_RANK"),
              "node": _env_int("SPARSECAR_NODE_RANK"), "model": args.model, "method": args.method,
              "device": args.device, "torch": torch.__version__,
              "ld_library_path": os.environ.get("LD_LIBRARY_PATH")}

    def emit(extra):
        result.update(extra)
        line = json.dumps(result)
        if args.out:
            with open(args.out, "w") as f:
                f.write(line + "\n")
        print(line, flush=True)

    try:
        model = build_model(args.model, torch, args.image_size)
    except ImportError as e:
        print(f"ddp_trainer: {args.model} skipped: {e}", file=sys.stderr)
        emit({"skipped": f"{args.model}: {e}"})
        return SKIPPED

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("ddp_trainer: --device cuda but torch sees no GPU", file=sys.stderr)
            return 2
        torch.cuda.set_device(args.gpu)
        device = torch.device("cuda", args.gpu)
        result["device_name"] = torch.cuda.get_device_name(device)
        result["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    else:
        device = torch.device("cpu")
        result["device_name"] = "cpu"
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    result["backend"] = backend
    dist.init_process_group(backend, init_method="env://", rank=args.rank, world_size=args.world)

    torch.manual_seed(args.seed)  # the same initial parameters on every rank (DDP broadcasts them too)
    model = build_model(args.model, torch, args.image_size).to(device)
    dtype = getattr(torch, args.dtype)
    if args.model not in FMNIST_MODELS:
        model = model.to(dtype)
    result["dtype"] = args.dtype if args.model not in FMNIST_MODELS else "float32"
    params = sum(p.numel() for p in model.parameters())
    result.update(params=params, batch=args.batch, warmup=args.warmup,
                  dense_ring_bytes_per_step=int(2 * (args.world - 1) / args.world * 4 * params))
    ddp = DDP(model, device_ids=[args.gpu] if args.device == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9,
                          weight_decay=5e-4 if args.model in FMNIST_MODELS else 0.0)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    loss_fn = torch.nn.functional.cross_entropy

    def flag_max(value):
        """One MAX all-reduce of a float on the gradients' device (outside the clock)."""
        t = torch.tensor([float(value)], dtype=torch.float64 if args.device == "cpu" else torch.float32,
                         device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    # Compute time without any exchange (no_sync: DDP skips the all-reduce); also warms cuDNN up.
    if args.model in FMNIST_MODELS:
        x0 = torch.randn(args.batch, 1, 28, 28, device=device)
        y0 = torch.randint(0, 10, (args.batch,), device=device)
    else:
        x0, y0 = synthetic_batch(args.model, torch, args.batch, args.image_size, device, args.seed + args.rank)
        x0 = x0.to(dtype)
    compute = []
    buffers = [b.detach().clone() for b in ddp.module.buffers()]  # BatchNorm's running statistics
    with ddp.no_sync():
        for _ in range(4):
            sync()
            t = time.perf_counter()
            loss_fn(ddp(x0), y0).backward()
            sync()
            compute.append(time.perf_counter() - t)
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():  # the training starts from the model as built: no trace of the random batch
        for b, saved in zip(ddp.module.buffers(), buffers):
            b.copy_(saved)
    compute_s = statistics.median(compute[1:])
    result["compute_ms"] = compute_s * 1e3

    hook = None
    if args.method == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=max(2, args.powersgd_start),
                                            min_compression_rate=2, use_error_feedback=True, warm_start=True,
                                            random_seed=args.seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        result["powersgd"] = {"rank": args.powersgd_rank, "start_iter": max(2, args.powersgd_start)}
    elif args.method == "sparsecar":
        import sparsecar.torch
        extra_kw = {"device_path": args.device_path} if args.device_path else {}  # older hooks lack it
        if args.agreement:
            extra_kw["agreement"] = args.agreement
        if args.dense_iterations:
            extra_kw["dense_iterations"] = args.dense_iterations
            result["dense_iterations"] = args.dense_iterations
        if args.momentum_correction:
            extra_kw["momentum_correction"] = True
        hook = sparsecar.torch.register(ddp, socket=args.socket, optimizer=opt, timeout=args.hook_timeout,
                                        announce="rank0", **extra_kw)

    def report(loss):
        if hook is not None:
            if args.report_compute_time:
                hook.report_metric("compute_time", compute_s)
            hook.report_metric("loss", float(loss))

    if args.model in FMNIST_MODELS:
        extra = train_fmnist(args, torch, dist, ddp, opt, device, sync, report)
    else:
        extra = time_steps(args, torch, dist, ddp, opt, device, sync, report, x0, y0, flag_max)

    extra.update(parameter_agreement(torch, dist, ddp))
    if hook is not None:
        s = hook.summary()
        extra["hook"] = {k: s.get(k) for k in ("mode", "iterations", "sparse_iterations", "bytes_sent",
                                                "dense_bytes", "ratio", "density", "mean_exchange_s", "failure",
                                                "dense_step_s", "dense_wait_s", "momentum_correction",
                                                "compute_s", "trainer_reduced_buckets", "leases",
                                                "leased_iterations")}
        extra["hook_path"] = s.get("path")  # "device" (CUDA IPC) or "host" (staged); absent in older hooks
        extra["hook_agreement"] = s.get("agreement")  # "gloo" (side group) or "device"; absent in older hooks
        through = (s.get("sparse_iterations") or 0) + (s.get("leased_iterations") or 0)
        if through:  # a leased iteration counts the ring's bytes, as its granting step did
            extra["payload_bytes_per_step"] = s["bytes_sent"] / through
        hook.close()
    emit(extra)  # before the teardown: a hanging destroy must not lose the results (the runner stops it)
    if hook is not None and extra["hook"]["mode"] != "sparse":
        print(f"ddp_trainer: the sparsecar hook ended in mode {extra['hook']['mode']}: {extra['hook']['failure']}",
              file=sys.stderr)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def parameter_agreement(torch, dist, ddp):
    """Whether every rank ends with the same parameters, bit for bit: a SHA-256 of this rank's
    parameter bytes, gathered from every rank (outside the clock)."""
    import hashlib
    h = hashlib.sha256()
    with torch.no_grad():
        for p in ddp.module.parameters():
            h.update(p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    mine = h.hexdigest()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"params_sha256": mine, "params_identical": all(d == mine for d in every)}


def time_steps(args, torch, dist, ddp, opt, device, sync, report, x, y, flag_max):
    def step():
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        sync()
        dt = time.perf_counter() - t
        report(loss.item())
        return dt

    dist.barrier()
    start_up_s = time.perf_counter() - T_START
    warm = [step() for _ in range(args.warmup)]
    # Every rank must run the same number of steps: agree on the slowest rank's last warm-up step.
    per_step = flag_max(warm[-1])
    n = max(args.min_steps, min(args.steps, int(args.budget_s / max(per_step, 1e-6))))
    times = [step() for _ in range(n)]
    return {"start_up_s": start_up_s, "steps_timed": n, "warmup_ms": [w * 1e3 for w in warm], "step_ms": stats_ms(times),
            "step_ms_all": [round(t * 1e3, 3) for t in times]}


def train_fmnist(args, torch, dist, ddp, opt, device, sync, report):
    import numpy as np
    tx, ty, vx, vy = load_fmnist(args.data_dir, np)
    mean, std = FMNIST_MEAN, FMNIST_STD

    def to_tensor(images, labels):
        x = torch.from_numpy(images.astype(np.float32) / 255.0).sub_(mean).div_(std).unsqueeze(1)
        return x.to(device), torch.from_numpy(labels.astype(np.int64)).to(device)

    shard = np.random.default_rng(args.seed).permutation(len(ty))[args.rank::args.world]
    xs, ys = to_tensor(tx[shard], ty[shard])
    if args.eval_limit:
        vx, vy = vx[:args.eval_limit], vy[:args.eval_limit]
    xt, yt = to_tensor(vx, vy)
    per_epoch = len(shard) // args.batch
    total = max(1, int(args.epochs * per_epoch))
    rng = np.random.default_rng(args.seed * 1000 + args.rank)

    def evaluate():
        ddp.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, len(yt), 2000):
                correct += int((ddp.module(xt[i:i + 2000]).argmax(1) == yt[i:i + 2000]).sum())
        ddp.train()
        return correct / len(yt)

    curve, steps_s = [], []
    eval_s = 0.0
    dist.barrier()
    start_up_s = time.perf_counter() - T_START
    t0 = time.perf_counter()
    order = None
    for step in range(total):
        if step % per_epoch == 0:
            order = torch.from_numpy(rng.permutation(len(ys))).to(device)
        idx = order[(step % per_epoch) * args.batch:(step % per_epoch + 1) * args.batch]
        ts = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(xs[idx]), ys[idx])
        loss.backward()
        opt.step()
        sync()
        steps_s.append(time.perf_counter() - ts)
        report(loss.item())
        if (step + 1) % args.eval_every == 0 or step == total - 1:
            te = time.perf_counter()
            acc = evaluate()
            dist.barrier()  # every rank evaluates; the slower one's time stays out of the clock too
            curve.append([step + 1, round(te - t0 - eval_s, 4), acc])
            eval_s += time.perf_counter() - te
    train_s = time.perf_counter() - t0 - eval_s
    return {"start_up_s": start_up_s, "steps": total, "epochs": args.epochs, "test_images": len(yt), "train_seconds": train_s, "eval_seconds": eval_s,
            "final_accuracy": curve[-1][2], "curve": curve, "step_ms": stats_ms(steps_s[args.warmup:])}


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # The results are written: skip the interpreter's teardown, which hung here for minutes now
    # and then after a gloo PowerSGD run (torch 1.13) with every rank's results already out.
    os._exit(rc)
