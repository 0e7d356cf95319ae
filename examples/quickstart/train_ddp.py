#!/usr/bin/env python3
"""The quick start's trainer: a small PyTorch DDP job whose gradients go through sparsecar.

Start it with torch's launcher, one launcher per node (see run.sh and README.md, "Quick start on
one host"). It reads only the launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) and
SPARSECAR_SOCKET, the Unix socket of its node's sparsecard. The data is a seeded synthetic
classification problem, so nothing needs downloading; the model's parameters have names
(fc1.weight, fc1.bias, ...) that a daemon's per-tensor overrides can match.
"""
import argparse
import collections
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecar.torch


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="training steps")
    ap.add_argument("--lr", type=float, default=0.1)
    args = ap.parse_args()

    dist.init_process_group("gloo")  # env:// — the launcher sets RANK, WORLD_SIZE, MASTER_*
    rank, world = dist.get_rank(), dist.get_world_size()

    # A fixed linear teacher labels Gaussian inputs; each rank trains on its own shard.
    g = torch.Generator().manual_seed(1234)
    teacher = torch.randn(32, 4, generator=g)
    x = torch.randn(4096, 32, generator=g)
    y = (x @ teacher).argmax(dim=1)
    xs, ys = x[rank::world], y[rank::world]

    torch.manual_seed(0)  # the same initial parameters on every rank
    net = torch.nn.Sequential(collections.OrderedDict(
        fc1=torch.nn.Linear(32, 64), act=torch.nn.ReLU(), fc2=torch.nn.Linear(64, 4)))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    # tensors="parameters": one sparsecar tensor per parameter, so the quick start's
    # '*.bias: compression=off' override reaches them (the default is one tensor per DDP bucket).
    hook = sparsecar.torch.register(model, socket=os.environ.get("SPARSECAR_SOCKET"), optimizer=opt,
                                    on_error="raise", tensors="parameters")

    for step in range(args.steps):
        i = (step * 64) % (len(ys) - 64)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(xs[i:i + 64]), ys[i:i + 64])
        loss.backward()
        opt.step()
        hook.report_metric("loss", loss.item())

    with torch.no_grad():
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    if rank == 0:
        print(hook.summary_line(), file=sys.stderr)
        print(f"train_ddp: {world} ranks, {args.steps} steps, final loss {loss.item():.4f}, "
              f"accuracy {accuracy:.3f}", flush=True)
    hook.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
