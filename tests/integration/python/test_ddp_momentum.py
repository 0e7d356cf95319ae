"""sparsecar.torch.register(..., momentum_correction=True): the hook takes SGD momentum over from
the optimizer (DGC's momentum correction). Dense steps must be SGD with momentum exactly, sparse
steps must mask the velocity where the average went out, and the velocity must survive a
state_dict() round trip. One rank in a 1-rank gloo group, real daemons (make_job)."""
import os

import pytest

torch = pytest.importorskip("torch")
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import sparsecar  # noqa: E402
import sparsecar.torch  # noqa: E402

M, LR = 0.9, 0.1


class Net(torch.nn.Module):
    """Registered in the other order than used: DDP's first bucket holds out.weight, out.bias,
    inp.weight, inp.bias, and its rebuild after the first iteration (in the order gradients
    became ready) reorders them, so a velocity kept by bucket offset only would be misaligned."""

    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(32, 4)
        self.inp = torch.nn.Linear(16, 32)

    def forward(self, x):
        return self.out(torch.relu(self.inp(x)))


def make_net():
    torch.manual_seed(0)
    return Net()


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def loss_of(model, seed):
    x, y = batch(seed)
    return torch.nn.functional.cross_entropy(model(x), y)


def train_step(model, opt, seed):
    opt.zero_grad(set_to_none=True)
    loss_of(model, seed).backward()
    opt.step()


class Float64MomentumSGD:
    """The reference: SGD with momentum as the textbook writes it, in float64 on an undistributed
    copy of the model (u = m*u + g; p -= lr*u)."""

    def __init__(self, net):
        self.net = net.double()
        self.u = {n: torch.zeros_like(p) for n, p in self.net.named_parameters()}

    def step(self, seed):
        self.net.zero_grad(set_to_none=True)
        x, y = batch(seed)
        torch.nn.functional.cross_entropy(self.net(x.double()), y).backward()
        with torch.no_grad():
            for n, p in self.net.named_parameters():
                self.u[n] = M * self.u[n] + p.grad
                p -= LR * self.u[n]


def assert_params_match(model, ref_float32, ref_float64, step):
    for (name, p), q, r in zip(model.module.named_parameters(), ref_float32.parameters(),
                               ref_float64.net.parameters()):
        # torch's SGD(momentum) on a float32 copy does the same float32 operations in the same
        # order (u = m*u + g, p -= lr*u; the 1-trainer average divides by 1): equal up to rounding
        # of the dense exchanges, a few ulp.
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step} {name} vs SGD: {m}")
        # float32 against float64 drifts by rounding only: |p| < 1, a few steps, lr 0.1.
        torch.testing.assert_close(p.double(), r, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"step {step} {name} vs float64: {m}")


def capture_buckets(monkeypatch, log):
    """Wraps the hook's entry point: records each bucket's parameters, its gradient before the hook
    touched it, and the average its future returned."""
    real = sparsecar.torch._hook_entry

    def entry(state, bucket):
        rec = {"index": bucket.index(), "params": [id(p) for p in bucket.parameters()],
               "g": bucket.buffer().detach().clone()}
        log.append(rec)

        def keep(fut):
            rec["avg"] = fut.value().detach().clone()
            return fut.value()
        return real(state, bucket).then(keep)
    monkeypatch.setattr(sparsecar.torch, "_hook_entry", entry)


@pytest.mark.parametrize("collective", ["ring", "trainer"])
def test_dense_steps_are_sgd_with_momentum(group, make_job, monkeypatch, collective):
    """Compression off: every step is dense (2 warm-up all-reduces by the hook, then the daemon's
    dense ring), so the hook with the momentum moved out of the optimizer must train exactly as
    torch's SGD(momentum=0.9) on an undistributed model, and as a float64 reference. With
    dense_collective=trainer the daemon hands the steps back for the hook's all-reduce and leases
    the next ones (1, 2, 4: steps 3, 5-6, 8 run without the daemon): the same training."""
    job = make_job(nodes=1, daemon_args=["--compression", "off", "--dense-collective", collective])
    log = []
    capture_buckets(monkeypatch, log)
    model = DDP(make_net())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=M)
    hook = sparsecar.torch.register(model, socket=job.sockets[0], optimizer=opt, timeout=20, on_error="raise",
                                    announce=None, momentum_correction=True)
    assert [g["momentum"] for g in opt.param_groups] == [0.0] and hook.summary()["momentum_correction"] == M
    ref = make_net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=M)
    ref64 = Float64MomentumSGD(make_net())
    for step in range(9):
        train_step(model, opt, step)
        train_step(ref, ref_opt, step)
        ref64.step(step)
        assert_params_match(model, ref, ref64, step)
    st = hook.stats
    assert hook.mode == "sparse" and st["failed_steps"] == 0
    assert st["sparse_buckets"] + st["leased_buckets"] >= 7, st
    assert (st["leased_iterations"] >= 3) if collective == "trainer" else (st["leased_iterations"] == 0), st
    assert hook.stats["sparsecar_nnz"] == hook.stats["sparsecar_elements"]  # the daemon ran dense steps
    # DDP's rebuild reordered the bucket after iteration 0: the velocity followed its parameters.
    assert log[0]["params"] != log[1]["params"] and sorted(log[0]["params"]) == sorted(log[1]["params"])
    hook.close()


@pytest.mark.parametrize("tensors,dense_from", [("buckets", None), ("parameters", None), ("buckets", 5)])
def test_sparse_steps_mask_the_velocity_where_the_average_went_out(group, make_job, monkeypatch, tmp_path, tensors,
                                                                    dense_from):
    """Top-k at density 0.1 on one node: the daemon's average is top-k(residual + u) (per bucket,
    or per parameter slice of it) and u is zeroed exactly there, m*u + g elsewhere. The reference
    replays the captured gradients: u and the daemon's error feedback (residual += u; send top-k;
    residual -= sent) in float32, the same operations the hook and the daemon do.

    dense_from: the daemon's steps from that one on are dense (the schedule's
    schedule_dense_from; the daemon's steps count the hook's iterations): the first dense step sends residual + u, every coordinate with the
    velocity it held back, so u restarts everywhere (DGC's masking of what went out); the dense
    steps after it are SGD with momentum (u = m*u + g, the average is u)."""
    daemon_args = ["--density", "0.1"]
    if dense_from is not None:
        daemon_args += ["--controller", "schedule", "--schedule-dense-from", str(dense_from)]
    job = make_job(nodes=1, daemon_args=daemon_args)
    log = []
    capture_buckets(monkeypatch, log)
    model = DDP(make_net())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=M)
    hook = sparsecar.torch.register(model, socket=job.sockets[0], optimizer=opt, timeout=20, on_error="raise",
                                    announce=None, momentum_correction=True, tensors=tensors)
    warmup, steps = 2, 7 if dense_from is None else 9
    sparse_before = False
    sizes = {id(p): p.numel() for p in model.module.parameters()}
    u_ref, residual, checked, dense_checked, prev_params = None, None, 0, 0, None
    names = {id(p): n for n, p in model.module.named_parameters()}
    for step in range(steps):
        train_step(model, opt, step)
        (rec,) = [r for r in log if "seen" not in r]  # one bucket (676 elements)
        rec["seen"] = True
        g, avg = rec["g"], rec["avg"]
        if u_ref is None:
            u_ref = torch.zeros_like(g)
        elif rec["params"] != prev_params:  # DDP's rebuild: move each parameter's u along
            u_ref = relayout(u_ref, prev_params, rec["params"], model)
        prev_params = rec["params"]
        u_ref = u_ref * M + g
        if step < warmup:
            torch.testing.assert_close(avg, u_ref, rtol=0, atol=0)  # 1 rank: the average is u itself
        elif dense_from is not None and step >= dense_from:  # the daemon's steps are the hook's
            sent = u_ref if residual is None else residual + u_ref
            torch.testing.assert_close(avg, sent, rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step} (dense): {m}")
            residual = torch.zeros_like(g)
            if sparse_before:
                u_ref = torch.zeros_like(u_ref)
            sparse_before = False
            dense_checked += 1
        else:
            if residual is None:
                residual = torch.zeros_like(g)
            residual = residual + u_ref
            if tensors == "buckets":
                slices = [(0, g.numel())]
            else:  # the parameters back to back in the bucket's order
                offsets = [0]
                for pid in rec["params"]:
                    offsets.append(offsets[-1] + sizes[pid])
                slices = list(zip(offsets[:-1], [sizes[pid] for pid in rec["params"]]))
            sent, k_total = torch.zeros_like(g), 0
            for offset, n in slices:
                k = sparsecar.kernels.topk_count(n, 0.1)
                top = offset + residual[offset:offset + n].abs().topk(k).indices
                sent[top] = residual[top]
                residual[top] = 0
                k_total += k
            assert int((avg != 0).sum()) == k_total < g.numel(), step
            torch.testing.assert_close(avg, sent, rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step}: {m}")
            u_ref = torch.where(avg != 0, torch.zeros_like(u_ref), u_ref)
            sparse_before = True
            checked += 1
        u = hook._velocity[rec["index"]].u
        torch.testing.assert_close(u, u_ref, rtol=0, atol=0, msg=lambda m: f"step {step} velocity: {m}")
    sparse_steps = steps - warmup if dense_from is None else dense_from - warmup
    assert checked == sparse_steps and dense_checked == steps - warmup - sparse_steps
    assert hook.stats["sparse_buckets"] == steps - warmup
    # state_dict() carries u per parameter name.
    saved = hook.state_dict()["momentum"]
    assert saved["m"] == M
    # ... and which tensors' last daemon step was sparse: their next dense step restarts u.
    names_sent = sorted(sl.name for sl in hook._slices[rec["index"]])
    assert saved["sparse_before"] == ([] if dense_from is not None else names_sent)
    offset = 0
    for pid in prev_params:
        p = next(q for q in model.module.parameters() if id(q) == pid)
        torch.testing.assert_close(saved["velocity"][names[pid]], u_ref[offset:offset + p.numel()])
        offset += p.numel()
    state = hook.state_dict()
    hook.close()
    model2 = DDP(make_net())
    with pytest.warns(RuntimeWarning, match="falling back"):
        hook2 = sparsecar.torch.register(model2, socket=str(tmp_path / "none.sock"), connect_timeout=0.1,
                                         optimizer=torch.optim.SGD(model2.parameters(), lr=LR, momentum=M),
                                         announce=None, momentum_correction=True, tensors=tensors)
    hook2.load_state_dict(state)
    assert sorted(hook2._sparse_before) == saved["sparse_before"]


def relayout(u, old_params, new_params, model):
    sizes = {id(p): p.numel() for p in model.module.parameters()}
    pieces, offset = {}, 0
    for pid in old_params:
        pieces[pid] = u[offset:offset + sizes[pid]]
        offset += sizes[pid]
    return torch.cat([pieces[pid] for pid in new_params])


@pytest.mark.parametrize("correction,momentum,given,warned", [(False, M, True, True), (False, M, False, True),
                                                             (True, M, True, False), (False, 0.0, True, False)])
def test_a_switch_from_dense_to_sparse_steps_is_counted_and_said_once_without_the_correction(
        group, make_job, caplog, correction, momentum, given, warned):
    """The schedule's dense warm-up (the daemon's steps 2-23 dense, from 24 top-k 10 %) is one
    switch from dense steps to sparse ones, counted in summary(); with SGD momentum outside the
    hook (no momentum_correction; also where the hook is given no optimizer and cannot tell) the
    log says once what such a switch costs; with the correction, or an optimizer without
    momentum, it says nothing (nothing amplifies the bursts). Before its first step the daemon
    hears whether the hook corrects momentum (the step controller's price of a sparse step: its
    StartHint), and says so in its log."""
    job = make_job(nodes=1, daemon_args=["--density", "0.1", "--controller", "schedule",
                                         "--schedule-warmup-steps", "24", "--schedule-ramp-steps", "0",
                                         "--log-level", "info"])
    model = DDP(make_net())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    hook = sparsecar.torch.register(model, socket=job.sockets[0], optimizer=opt if given else None, timeout=20,
                                    on_error="raise", announce=None,
                                    momentum_correction=correction)
    caplog.set_level("WARNING", logger="sparsecar.torch")
    for step in range(23):
        train_step(model, opt, step)
    assert hook.summary()["dense_to_sparse_switches"] == 0
    assert hook.stats["sparsecar_nnz"] == hook.stats["sparsecar_elements"] > 0  # dense daemon steps so far
    for step in range(23, 28):
        train_step(model, opt, step)
    s = hook.summary()
    assert s["failed_steps"] == 0 and s["sparse_iterations"] == 26, s
    assert s["dense_to_sparse_switches"] == 1, s
    said = [r for r in caplog.records if "dense steps to sparse ones" in r.getMessage()]
    assert len(said) == (1 if warned else 0), [r.getMessage() for r in said]
    if warned:
        assert "22 dense steps" in said[0].getMessage() and "momentum_correction=True" in said[0].getMessage()
    hook.close()
    want = "momentum corrected by the hook" if correction else "momentum not corrected"
    with open(os.path.join(job.dir, "sparsecard-0.log"), errors="replace") as f:
        hints = [line for line in f if "the trainer's dense steps before step 2:" in line]
    assert len(hints) == 1 and want in hints[0], hints


def test_state_dict_round_trip_keeps_the_velocity(group, make_job, tmp_path):
    """4 steps through the daemon (dense), save model + hook, then a new model and hook restored
    from the files continue (with no daemon: the fallback all-reduce, also momentum SGD). The
    parameters must follow torch's SGD(momentum) run without a restart; a restore without the
    velocity would restart the momentum and drift."""
    job = make_job(nodes=1, daemon_args=["--compression", "off"])
    model = DDP(make_net())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=M)
    hook = sparsecar.torch.register(model, socket=job.sockets[0], optimizer=opt, timeout=20, on_error="raise",
                                    announce=None, momentum_correction=True)
    ref = make_net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=M)
    for step in range(4):
        train_step(model, opt, step)
        train_step(ref, ref_opt, step)
    assert hook.mode == "sparse"
    torch.save({"model": model.module.state_dict(), "hook": hook.state_dict()}, tmp_path / "ckpt.pt")
    hook.close()

    ckpt = torch.load(tmp_path / "ckpt.pt")
    net2 = make_net()
    net2.load_state_dict(ckpt["model"])
    model2 = DDP(net2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=LR, momentum=M)
    with pytest.warns(RuntimeWarning, match="falling back"):
        hook2 = sparsecar.torch.register(model2, socket=str(tmp_path / "none.sock"), optimizer=opt2,
                                         connect_timeout=0.1, announce=None, momentum_correction=True)
    hook2.load_state_dict(ckpt["hook"])
    for step in range(4, 7):
        train_step(model2, opt2, step)
        train_step(ref, ref_opt, step)
        for (name, p), q in zip(model2.module.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step} {name}: {m}")
    assert hook2.mode == "fallback" and hook2.stats["dense_buckets"] >= 3

    # A hook without the correction must not silently drop a saved velocity.
    model3 = DDP(make_net())
    with pytest.warns(RuntimeWarning, match="falling back"):
        hook3 = sparsecar.torch.register(model3, socket=str(tmp_path / "none.sock"), connect_timeout=0.1,
                                         announce=None)
    with pytest.raises(ValueError, match="momentum_correction=True"):
        hook3.load_state_dict(ckpt["hook"])


@pytest.mark.parametrize("make_opt,message", [
    (lambda ps: None, "needs optimizer="),
    (lambda ps: torch.optim.Adam(ps, lr=0.1), "torch.optim.SGD.*got Adam"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), r"momentum > 0 \(the optimizer has momentum 0"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), "Nesterov"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1), "dampening 0"),
    (lambda ps: torch.optim.SGD([{"params": ps[:2]}, {"params": ps[2:], "momentum": 0.5}], lr=0.1,
                                momentum=0.9), r"one momentum in every param group.*\[0.5, 0.9\]"),
])
def test_bad_optimizers_are_refused_and_left_alone(group, tmp_path, make_opt, message):
    model = DDP(make_net())
    opt = make_opt(list(model.parameters()))
    before = [dict(g, params=None) for g in opt.param_groups] if opt is not None else None
    with pytest.raises(ValueError, match=message):
        sparsecar.torch.register(model, socket=str(tmp_path / "none.sock"), optimizer=opt, connect_timeout=0.1,
                                 momentum_correction=True)
    if opt is not None:
        assert [dict(g, params=None) for g in opt.param_groups] == before
