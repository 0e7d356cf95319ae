"""sparsecar.torch.register: the DDP comm hook. In-process tests use a 1-rank gloo group; the
multi-process test runs 4 DDP ranks through 2 daemons (bench/convergence/ddp_digits.py)."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import sparsecar.torch  # noqa: E402
from conftest import BENCH  # noqa: E402


def make_models():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ref.load_state_dict(net.state_dict())
    return DDP(net), ref


def step_and_compare(model, ref, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(m(x), y).backward()
    for p, q in zip(model.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_unreachable_daemon_falls_back_with_one_warning(group, tmp_path):
    model, ref = make_models()
    with pytest.warns(RuntimeWarning, match="falling back to plain all-reduce"):
        hook = sparsecar.torch.register(model, socket=str(tmp_path / "none.sock"), connect_timeout=0.2)
    assert hook.mode == "fallback" and "cannot connect" in hook.failure
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        for i in range(4):
            step_and_compare(model, ref, i)
    assert hook.stats["dense_buckets"] >= 4


def test_unreachable_daemon_raises_when_asked(group, tmp_path):
    model, _ = make_models()
    with pytest.raises(RuntimeError, match="cannot connect"):
        sparsecar.torch.register(model, socket=str(tmp_path / "none.sock"), connect_timeout=0.2,
                                 on_error="raise")


def make_large_models(**ddp_args):
    """A model of more than DDP's first bucket (1 MiB of gradients): DDP's one rebuild of its
    buckets changes them (one bucket becomes two)."""
    torch.manual_seed(0)
    layers = (torch.nn.Linear(16, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 300), torch.nn.ReLU(),
              torch.nn.Linear(300, 4))
    net = torch.nn.Sequential(*layers)
    ref = torch.nn.Sequential(*(type(m)(m.in_features, m.out_features) if isinstance(m, torch.nn.Linear)
                                else torch.nn.ReLU() for m in layers))
    ref.load_state_dict(net.state_dict())
    return DDP(net, **ddp_args), ref


@pytest.mark.parametrize("ddp_args, dense", [({}, 2), ({"static_graph": True}, 3)],
                         ids=["rebuilt_after_the_first", "static_graph_rebuilt_after_the_second"])
def test_sparsecar_takes_over_once_ddps_rebuild_is_done(group, make_job, ddp_args, dense):
    """DDP rebuilds its buckets once: in the second iteration's forward, or with static_graph in
    the third's (torch 1.13). The hook registers the rebuilt buckets as soon as it has seen them:
    after 2 dense iterations (a rebuild it saw change the buckets is the last; a third, dense on a
    slow link, confirmed nothing), and with static_graph after 3, not on the 2 equal ones before
    the rebuild (which then failed the next step and fell back to plain all-reduce for good).
    Compression off: the daemon's averages are the exact ones, compared with a plain model's."""
    job = make_job(nodes=1, daemon_args=["--compression", "off"])
    model, ref = make_large_models(**ddp_args)
    hook = sparsecar.torch.register(model, socket=job.sockets[0], lr=0.1, timeout=20, announce=None)
    for i in range(dense):
        assert hook.mode == "warmup", (i, hook.failure)
        step_and_compare(model, ref, i)
    assert hook.mode == "sparse", hook.failure
    assert len(hook.tensor_names) == 2  # the rebuilt buckets, not the first iteration's one
    for i in range(dense, dense + 3):
        step_and_compare(model, ref, i)
    s = hook.summary()
    assert hook.mode == "sparse" and hook.stats["failed_steps"] == 0, (hook.failure, s)
    assert s["sparse_iterations"] == 3 and len(s["dense_steps_s"]) == dense, s
    hook.close()


def test_hook_uses_daemon_then_falls_back_when_it_dies(group, make_job):
    job = make_job(nodes=1, daemon_args=["--compression", "off"])
    model, ref = make_models()
    hook = sparsecar.torch.register(model, socket=job.sockets[0], lr=0.1, timeout=20)
    for i in range(2):  # dense warm-up while DDP rebuilds its buckets
        step_and_compare(model, ref, i)
    assert hook.mode == "sparse"
    for i in range(2, 5):
        step_and_compare(model, ref, i)
        hook.report_metric("loss", 1.0 / i)
    assert hook.stats["sparse_buckets"] >= 3 and hook.stats["failed_steps"] == 0
    job.stop_all()  # the daemon goes away mid-job
    with pytest.warns(RuntimeWarning, match="falling back"):
        step_and_compare(model, ref, 5)  # this step fails in sparsecar, all-reduce fills it
    for i in range(6, 8):
        step_and_compare(model, ref, i)
    assert hook.mode == "fallback" and hook.stats["failed_steps"] >= 1
    hook.close()


def test_four_ranks_two_daemons_match_plain_allreduce(sparsecard, tmp_path):
    out = tmp_path / "ddp.json"
    env = dict(os.environ)
    r = subprocess.run([sys.executable, os.path.join(BENCH, "ddp_digits.py"), "--sparsecard", sparsecard,
                        "--pythonpath", os.environ.get("PYTHONPATH", ""), "--methods", "dense,sparsecar",
                        "--compression", "off", "--steps", "25", "--out", str(out), "--timeout", "240"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads(out.read_text())
    sc = s["methods"]["sparsecar"]
    assert sc["hook_mode"] == "sparse" and sc["hook"]["sparse_buckets"] >= 23
    # compression off: the daemons' exact dense mean (a different summation order than gloo)
    assert sc["max_abs_diff_vs_dense"] < 1e-5
    assert sc["accuracy"] == pytest.approx(s["methods"]["dense"]["accuracy"], abs=0.003)
    assert sc["rank_checksum_spread"] == 0.0


@pytest.mark.parametrize("lease", [0, 16])
def test_dense_steps_reduced_by_the_trainers_match_plain_allreduce(sparsecard, tmp_path, lease):
    """dense_collective=trainer on 2 daemons x 2 ranks: every dense step comes back as each
    rank's share of its node's part, the hook all-reduces it over gloo, and the model ends where
    plain DDP's does (the same 1e-5 bound as the daemons' ring above); every rank identical.
    With the knob trainer_lease (default 16) every step is a trainer-reduced dense one here, so a
    step through the daemons leases the next 1, 2, 4, 8, 16 (doubling to the knob): of the 23
    steps after the hook's 2 dense ones, steps 2, 4, 7, 12 and 21 go through the daemons, the
    other 18 (3, 5-6, 8-11, 13-20, 22-24: 3 of 21's 16) are all-reduced by the hook alone. A
    step that comes 2x slower than the trainers' pace restarts the doubling (a stall on a
    loaded box can), but every step through the daemons leases at least the next one: at least
    11 leased. With 0 every step goes through the daemons."""
    s = _ddp_digits(sparsecard, tmp_path, ["--methods", "dense,sparsecar", "--compression", "off", "--steps", "25",
                                           "--timeout", "240", "--daemon-arg=--dense-collective=trainer",
                                           f"--daemon-arg=--trainer-lease={lease}"],
                    timeout=300)
    sc = s["methods"]["sparsecar"]
    hook = sc["hook"]
    through, leased = hook["sparse_iterations"], hook.get("leased_iterations", 0)
    assert sc["hook_mode"] == "sparse" and through + leased == 23, hook
    assert (leased == 0) if lease == 0 else (11 <= leased <= 18), hook
    assert hook.get("leases", 0) == (through if lease else 0), hook
    buckets = hook["sparse_buckets"] // through
    assert buckets >= 1 and hook["sparse_buckets"] == through * buckets, hook
    assert hook.get("leased_buckets", 0) == leased * buckets, hook
    assert hook.get("trainer_reduced_buckets") == hook["sparse_buckets"], hook
    # The trainer's compute is still timed: an iteration that granted a lease up to the first
    # bucket of the leased one after it, reported at the next step through the daemons.
    assert sc["hook_compute_s"] is not None and sc["hook_compute_s"] > 0, sc["hook_compute_s"]
    assert sc["max_abs_diff_vs_dense"] < 1e-5
    assert sc["rank_checksum_spread"] == 0.0


def test_a_dense_step_after_sparse_ones_hands_the_residual_to_the_trainers(sparsecard, tmp_path):
    """Top-k with a dense step every 4th step (schedule_dense_every), reduced by the trainers: the
    dense steps carry the residual the sparse ones left (error feedback: nothing lost), so over
    a whole period of 4 steps the sum of the applied averages is the sum of the gradients; the
    job's loss falls as with the daemons' ring, and every rank stays identical."""
    common = ["--methods", "sparsecar", "--compression", "on", "--density", "0.01", "--steps", "40",
              "--timeout", "240", "--daemon-arg=--controller=schedule", "--daemon-arg=--schedule-dense-every=4"]
    for d in ("ring", "trainer"):
        (tmp_path / d).mkdir()
    ring = _ddp_digits(sparsecard, tmp_path / "ring", common, timeout=300)["methods"]["sparsecar"]
    tr = _ddp_digits(sparsecard, tmp_path / "trainer", common + ["--daemon-arg=--dense-collective=trainer"],
                     timeout=300)["methods"]["sparsecar"]
    assert tr["hook_mode"] == "sparse" and tr["rank_checksum_spread"] == 0.0, tr
    # steps 3, 7, ..., 39 (dense where (step + 1) % 4 == 0) of the 38 after the hook's 2 dense ones
    buckets = tr["hook"]["sparse_buckets"] // 38
    assert buckets >= 1 and tr["hook"]["sparse_buckets"] == 38 * buckets, tr["hook"]
    assert tr["hook"]["trainer_reduced_buckets"] == 10 * buckets, tr["hook"]
    assert ring["hook"].get("trainer_reduced_buckets", 0) == 0, ring["hook"]
    assert tr["losses"][-1] == pytest.approx(ring["losses"][-1], rel=0.05, abs=0.02), (tr["losses"], ring["losses"])


def _ddp_digits(sparsecard, tmp_path, extra, env_extra=None, timeout=600):
    out = tmp_path / "ddp.json"
    env = dict(os.environ)
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, os.path.join(BENCH, "ddp_digits.py"), "--sparsecard", sparsecard,
                        "--pythonpath", os.environ.get("PYTHONPATH", ""), "--out", str(out)] + extra,
                       env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


def test_twenty_ddp_jobs_on_the_same_daemons_all_succeed_identically(sparsecard, tmp_path):
    """Long-lived daemons: 20 DDP jobs one after another (each a new process group, its step
    counter starting at 0 again). Every job runs on sparsecar to the end and every rank ends with
    bit-identical parameters."""
    s = _ddp_digits(sparsecard, tmp_path, ["--methods", "sparsecar", "--nodes", "2", "--local-clients", "1",
                                           "--steps", "5", "--jobs", "20", "--compression", "on",
                                           "--density", "0.05", "--timeout", "120"])
    assert len(s["jobs"]) == 20
    for j, job in enumerate(s["jobs"]):
        sc = job["sparsecar"]
        assert sc["hook_mode"] == "sparse", (j, sc["hook_failure"])
        assert sc["hook"]["sparse_buckets"] >= 3, (j, sc["hook"])
        assert sc["ranks_identical"], j


def test_a_failure_seen_by_one_rank_makes_every_rank_fall_back_together(sparsecard, tmp_path):
    """Lost data messages (the daemons' test-only fault switch) fail a step on one node while its
    peer may complete it. The ranks agree at the end of the iteration: all of them all-reduce that
    iteration and fall back, and their parameters stay bit-identical. The agreement goes through
    the gloo side group (what a NCCL job gets by default), across processes."""
    s = _ddp_digits(sparsecard, tmp_path,
                    ["--methods", "sparsecar", "--nodes", "2", "--local-clients", "1", "--steps", "12",
                     "--compression", "on", "--density", "0.05", "--on-error", "fallback",
                     "--daemon-step-timeout", "1", "--step-timeout", "20", "--timeout", "240",
                     "--agreement", "gloo"],
                    env_extra={"SPARSECAR_TEST_FAULTS": "drop=0.3,seed=3,kinds=1"})
    sc = s["methods"]["sparsecar"]
    assert sc["hook_mode"] == "fallback", sc
    assert sc["hook"]["failed_steps"] >= 1
    assert sc["ranks_identical"]


# ---- the hook speaks in parameters, state_dict, summary, start line, node variables -----------

def _status(job, rank=0):
    ctl = os.environ.get("SPARSECARCTL")
    if not ctl:
        pytest.skip("SPARSECARCTL (path of the sparsecarctl binary) is not set")
    r = subprocess.run([ctl, "--endpoint", f"ipc://{job.dir}/control-{rank}.sock", "--json", "status"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads(r.stdout)
    return s.get("result", s)


def wait_until_no_client(job, timeout=20.0):
    """The daemon noticed the last session's end (and reset the job) — a new one may connect."""
    deadline = time.monotonic() + timeout
    while _status(job)["clients"]["connected"] != 0:
        assert time.monotonic() < deadline, "the daemon still counts a client"
        time.sleep(0.05)


def run_steps(model, ref, first, last):
    for i in range(first, last):
        step_and_compare_close(model, ref, i)


def step_and_compare_close(model, ref, seed):
    """One step on both models; the DDP model's gradients are the daemon's (compressed) ones."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(m(x), y).backward()


def test_parameters_go_by_name_and_shape_and_a_per_tensor_override_reaches_one(group, make_job, capsys):
    """Each parameter is its own sparsecar tensor, named as in named_parameters() and shaped;
    a `[tensor."0.weight"]`-style override (row top-k, a higher density) applies to that parameter
    only: its rows go whole and its density differs from every other parameter's."""
    job = make_job(nodes=1, daemon_args=["--density", "0.05",
                                         "--tensor-overrides", "0.weight: selector=row_topk, density=0.1"])
    model, ref = make_models()
    hook = sparsecar.torch.register(model, socket=job.sockets[0], lr=0.1, timeout=20, on_error="raise",
                                    tensors="parameters")
    run_steps(model, ref, 0, 6)
    assert hook.mode == "sparse", hook.failure
    names = [n for n, _ in model.module.named_parameters()]
    assert sorted(hook.tensor_names) == sorted(names)
    shapes = {sl.name: tuple(sl.tensor.registered_shape) for v in hook._slices.values() for sl in v}
    assert shapes == {n: tuple(p.shape) for n, p in model.module.named_parameters()}

    s = hook.summary(per_tensor=True)
    per = s["per_tensor"]
    w = per["0.weight"]  # [32, 16]: row top-k keeps 3 whole rows of 16 (top-k would keep 51)
    assert w["steps"] >= 3 and w["nnz"] == 48 * w["steps"], w
    assert sparsecar.kernels.topk_count(512, 0.1) != 48
    for name in ("0.bias", "2.weight"):  # 32 and 128 elements at density 0.05 (2.bias: k = 1 of 4)
        assert per[name]["density"] < 0.07, (name, per[name])
    # The daemon shows the override's plan (1 tensor) next to the global one (3 tensors).
    plans = {p: n for g in _status(job)["groups"] for p, n in g["plans"].items()}
    assert sorted((n, p.split()[1]) for p, n in plans.items()) == [(1, "density=0.1"), (3, "density=0.05")], plans
    # The start line: rank 0, once, on stderr.
    err = capsys.readouterr().err
    assert err.count("sparsecar: rank 0 of 1: 4 parameter tensors") == 1, err
    # One node puts nothing on the wire (the ratio needs two: the quick start test checks it).
    assert s["sparse_iterations"] >= 3 and s["bytes_sent"] == 0 and s["ratio"] is None
    assert 0 < s["density"] < 0.3 and s["mean_step_s"] > 0 and s["mean_exchange_s"] > 0
    assert f"6 iterations ({s['sparse_iterations']} through sparsecar)" in hook.summary_line()
    hook.close()


def test_buckets_mode_keeps_one_flat_tensor_per_bucket(group, make_job):
    job = make_job(nodes=1, daemon_args=["--compression", "off"])
    model, ref = make_models()
    hook = sparsecar.torch.register(model, socket=job.sockets[0], tensors="buckets", timeout=20,
                                    announce=None)
    for i in range(5):
        step_and_compare(model, ref, i)
    assert hook.mode == "sparse" and hook.tensor_names == ["ddp.bucket.0"]
    hook.close()


def test_state_dict_round_trip_continues_steps_layout_and_counters(group, make_job, tmp_path):
    job = make_job(nodes=1, daemon_args=["--compression", "off"])
    model, ref = make_models()
    hook = sparsecar.torch.register(model, socket=job.sockets[0], timeout=20, announce=None,
                                    tensors="parameters")
    for i in range(6):
        step_and_compare(model, ref, i)
    assert hook.mode == "sparse"
    saved = hook.summary()
    torch.save({"model": model.state_dict(), "hook": hook.state_dict()}, tmp_path / "ckpt.pt")
    names = hook.tensor_names
    hook.close()
    wait_until_no_client(job)

    # "Restart": a new DDP model and hook, restored before the first backward.
    ckpt = torch.load(tmp_path / "ckpt.pt")
    model2, ref2 = make_models()
    model2.load_state_dict(ckpt["model"])
    ref2.load_state_dict({k.removeprefix("module."): v for k, v in ckpt["model"].items()})
    hook2 = sparsecar.torch.register(model2, socket=job.sockets[0], timeout=20, announce=None,
                                     tensors="parameters")
    hook2.load_state_dict(ckpt["hook"])
    assert hook2.iteration == 6 and hook2.mode == "warmup"
    # DDP rebuilds its buckets after this process's first iteration; sparsecar takes over after
    # 2 dense iterations, with the same tensors in the same order (what a residual checkpoint needs).
    for i in range(6, 8):
        step_and_compare(model2, ref2, i)
    assert hook2.mode == "sparse" and hook2.tensor_names == names
    for i in range(8, 10):
        step_and_compare(model2, ref2, i)
    assert _status(job)["step"] == 9  # the daemon saw the restored step numbers
    s = hook2.summary()
    assert s["iterations"] == 10 and s["sparse_iterations"] == saved["sparse_iterations"] + 2
    assert s["dense_buckets"] > saved["dense_buckets"]
    hook2.close()
    wait_until_no_client(job)

    with pytest.raises(RuntimeError, match="before the first backward"):
        hook2.load_state_dict(ckpt["hook"])
    model3, _ = make_models()
    hook3 = sparsecar.torch.register(model3, socket=job.sockets[0], connect_timeout=5, announce=None,
                                     tensors="parameters")
    with pytest.raises(ValueError, match="version"):
        hook3.load_state_dict(dict(ckpt["hook"], version=99))
    with pytest.raises(ValueError, match="tensors="):
        hook3.load_state_dict(dict(ckpt["hook"], tensors="buckets"))
    hook3.close()


def test_node_values_come_from_sparsecar_or_node_variables_never_rank(monkeypatch):
    for k in ("SPARSECAR_NODE_RANK", "SPARSECAR_NNODES", "NODE_RANK", "NNODES"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert sparsecar.torch.node_rank() is None and sparsecar.torch.nnodes() is None
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("NNODES", "2")
    assert (sparsecar.torch.node_rank(), sparsecar.torch.nnodes()) == (1, 2)
    monkeypatch.setenv("SPARSECAR_NODE_RANK", "3")
    monkeypatch.setenv("SPARSECAR_NNODES", "4")
    assert (sparsecar.torch.node_rank(), sparsecar.torch.nnodes()) == (3, 4)
    monkeypatch.setenv("SPARSECAR_NNODES", "four")
    with pytest.raises(ValueError, match="SPARSECAR_NNODES"):
        sparsecar.torch.nnodes()


def test_agreement_runs_on_the_models_device(group, tmp_path, monkeypatch):
    """The agreement all-reduce uses a tensor on the parameters' device (under NCCL a CPU tensor
    fails); on this CPU machine that is the CPU, which gloo serves."""
    seen = []
    real = dist.all_reduce

    def spy(t, *a, **k):
        seen.append(t.device)
        return real(t, *a, **k)
    monkeypatch.setattr(dist, "all_reduce", spy)
    model, _ = make_models()
    with pytest.warns(RuntimeWarning):
        hook = sparsecar.torch.register(model, socket=str(tmp_path / "none.sock"), connect_timeout=0.1)
    assert hook.device == next(model.parameters()).device and seen == [hook.device]


def test_agreement_on_a_nccl_job_uses_a_gloo_side_group_without_a_gpu_sync(group, tmp_path, monkeypatch):
    """agreement="auto" under a NCCL default group creates a gloo side group and agrees with a CPU
    tensor through it (no CUDA stream is waited on); DDP's own group is not used for it."""
    calls = []
    real = dist.all_reduce

    def spy(t, *a, **k):
        calls.append((t.device.type, k.get("group")))
        return real(t, *a, **k)
    monkeypatch.setattr(dist, "all_reduce", spy)
    real_backend = dist.get_backend
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "nccl" if g is None else real_backend(g))
    model, _ = make_models()
    with pytest.warns(RuntimeWarning):
        hook = sparsecar.torch.register(model, socket=str(tmp_path / "none.sock"), connect_timeout=0.1)
    assert hook.agreement == "gloo" and hook.summary()["agreement"] == "gloo"
    assert hook._agree_group is not None
    assert calls == [("cpu", hook._agree_group)]
    assert real_backend(hook._agree_group) == "gloo"


def test_agreement_choices(group, tmp_path):
    model, _ = make_models()
    with pytest.raises(ValueError, match="agreement"):
        sparsecar.torch.register(model, socket=str(tmp_path / "none.sock"), agreement="nccl")
    with pytest.warns(RuntimeWarning):  # a gloo job agrees through its own group
        hook = sparsecar.torch.register(model, socket=str(tmp_path / "none.sock"), connect_timeout=0.1)
    assert hook.agreement == "device" and hook._agree_group is None


def test_status_says_what_the_accuracy_controller_acts_on(group, make_job):
    """A DDP job that reports no metric: the accuracy controller acts on the compression error
    ||e|| / ||g|| (which every step's observation carries), calibrates its bound, and rank 0's
    `sparsecarctl status` says so — in JSON and in its text."""
    job = make_job(nodes=1, daemon_args=["--density", "0.05", "--controller", "accuracy",
                                         "--accuracy-calibrate-steps", "3"])
    model, ref = make_models()
    hook = sparsecar.torch.register(model, socket=job.sockets[0], lr=0.1, timeout=20, on_error="raise",
                                    announce=None)
    run_steps(model, ref, 0, 12)
    assert hook.mode == "sparse", hook.failure
    deadline = time.monotonic() + 10
    while True:  # observations reach the controllers a little after the steps
        c = _status(job)["controllers"]
        if c["steps_observed"] >= 8 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert c["active"] == "accuracy" and c["steps_observed"] >= 8, c
    assert c["accuracy_signal"] == "compression error", c
    assert c["compression_error"] > 0 and c["compression_error_bound"] > 0, c
    ctl = os.environ["SPARSECARCTL"]
    r = subprocess.run([ctl, "--endpoint", f"ipc://{job.dir}/control-0.sock", "status"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "accuracy signal: compression error" in r.stdout, r.stdout + r.stderr
    hook.close()


def test_the_dense_iterations_timing_reaches_the_daemon_before_the_first_sparse_step(group, make_job):
    """The hook times its last dense iteration (its period, and the wait on the all-reduce after
    its last bucket) and reports both before its first submit; rank 0's daemon logs what it got,
    ahead of the first step it runs (its step controller weighs it: docs/controllers.md)."""
    job = make_job(nodes=1, daemon_args=["--density", "0.05", "--log-level", "info"])
    model, ref = make_models()
    hook = sparsecar.torch.register(model, socket=job.sockets[0], lr=0.1, timeout=20, on_error="raise",
                                    announce=None)
    run_steps(model, ref, 0, 4)
    assert hook.mode == "sparse", hook.failure
    s = hook.summary()
    step_s, wait_s = s["dense_step_s"], s["dense_wait_s"]
    assert step_s is not None and 0 < step_s < 30, s
    assert wait_s is not None and 0 <= wait_s < step_s, s
    log_path = os.path.join(job.dir, "sparsecard-0.log")
    want = f"the trainer's dense steps before step 2: {step_s * 1e3:.3g} ms a step, {wait_s * 1e3:.3g} ms of it"
    deadline = time.monotonic() + 10
    while True:  # the log is written by the daemon's own thread
        with open(log_path, errors="replace") as f:
            text = f.read()
        if want in text or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert want in text, text[-2000:]
    hook.close()


def test_a_stalled_dense_iteration_does_not_price_the_link(group, make_job):
    """The hook reports its quickest dense iteration, not its last: a 0.3 s stall after the last
    dense iteration's backward (another process holding the core, on a shared host) is in that
    iteration's period and rest and nowhere else, and the daemon must read neither the link nor
    the trainer's compute as 0.3 s a step."""
    job = make_job(nodes=1, daemon_args=["--density", "0.05"])
    model, ref = make_models()
    hook = sparsecar.torch.register(model, socket=job.sockets[0], lr=0.1, timeout=20, on_error="raise",
                                    announce=None)
    assert hook.dense_iterations == 2
    step_and_compare_close(model, ref, 0)
    step_and_compare_close(model, ref, 1)
    time.sleep(0.3)  # the stall: after iteration 1's last bucket, before iteration 2's first
    run_steps(model, ref, 2, 4)
    assert hook.mode == "sparse", hook.failure
    s = hook.summary()
    assert len(s["dense_steps_s"]) == 2, s
    assert s["dense_steps_s"][1] >= 0.3, s
    assert s["dense_step_s"] == min(s["dense_steps_s"]) < 0.3, s
    assert 0 <= s["dense_wait_s"] < s["dense_step_s"], s
    rests = [p - w for p, w in zip(s["dense_steps_s"], s["dense_waits_s"])]
    assert s["dense_step_s"] - s["dense_wait_s"] == pytest.approx(min(rests)) and min(rests) < 0.3, s
    hook.close()


def test_the_dense_clock_leaves_registering_out_of_the_period_and_takes_the_last_all_reduce():
    """The clock's arithmetic on host times (a GPU bucket's marks are CUDA events, read the same
    way through elapsed_time): an iteration from 10.0 s to the next one's first bucket at 12.0 s,
    its last bucket at 10.5 s, its all-reduces done at 10.9 s and 10.7 s (out of order), and the
    hook's registering after them until 11.2 s: period 2.0 - (11.2 - 10.9) = 1.7 s, wait 10.9 -
    10.5 = 0.4 s. Registering that ends before the all-reduce costs the step nothing."""
    buf = torch.zeros(4)
    clock = sparsecar.torch._DenseClock(buf, 10.0)
    assert not clock.complete
    clock.last_bucket = 10.5
    clock.done = [10.9, 10.7]
    clock.hook_end = 11.2
    assert clock.complete
    period, wait = clock.timing(12.0)
    assert period == pytest.approx(1.7) and wait == pytest.approx(0.4)
    clock.hook_end = 10.6
    assert clock.timing(12.0) == pytest.approx((2.0, 0.4))


def test_the_start_timing_takes_the_quickest_period_and_the_least_rest():
    """What the daemon weighs before its first step (it prices a sparse step at 2.5x the rest, the
    period less the wait; 3x when this was found): stalls only add, so the quickest period and the
    least rest of any dense iteration, which need not be the same iteration's. The numbers are a
    2-core box's first two dense iterations at 50 Mbit/s (a first iteration's rest 25.8 ms, the
    second's 5.7): with the quickest iteration's own wait the rest read 25.8 ms, a sparse step 77
    ms at 3x, and the warm-up stayed; with the least rest 84.5 ms is 4.9x a sparse step of 17.1 ms."""
    start = sparsecar.torch._start_timing
    assert start([]) is None
    assert start([(0.030, 0.020)]) == pytest.approx((0.030, 0.020))
    period, wait = start([(0.0845, 0.0587), (0.0851, 0.0794)])
    assert period == pytest.approx(0.0845)
    assert period - wait == pytest.approx(0.0851 - 0.0794)
    # The quickest with the least rest: its own timing.
    assert start([(0.040, 0.010), (0.020, 0.015)]) == pytest.approx((0.020, 0.015))
    # No wait at all: the least rest is a whole period, the wait 0.
    assert start([(0.012, 0.0), (0.010, 0.0)]) == pytest.approx((0.010, 0.0))


class _WatchedClient:
    """The hook's client, recording every metric it reports and, with `slower_wait`, every wait
    that many seconds longer: an exchange slower than the trainer's compute (a fake link in
    these tests only; the daemon behind it is the real one)."""

    def __init__(self, client, slower_wait=0.0):
        self._client = client
        self._slower_wait = slower_wait
        self.metrics = []

    def __getattr__(self, name):
        return getattr(self._client, name)

    def wait(self, *args, **kwargs):
        time.sleep(self._slower_wait)
        return self._client.wait(*args, **kwargs)

    def report_metric(self, name, value, step):
        self.metrics.append((name, value, step))
        return self._client.report_metric(name, value, step)


def _one_node_paced_loop(make_job, seed):
    """A one-node job with the hook, and its training step: one fixed batch's backward, then
    `pause` seconds outside the exchange (the rest of a training loop)."""
    job = make_job(nodes=1, daemon_args=["--density", "0.05"])
    model, _ = make_models()
    hook = sparsecar.torch.register(model, socket=job.sockets[0], lr=0.1, timeout=20, on_error="raise",
                                    announce=None)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)

    def step(pause):
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        time.sleep(pause)
    return hook, step


def test_the_hook_times_the_trainers_compute_without_the_exchange(group, make_job):
    """A trainer that reports no compute time: the hook times it on CPU buckets (the host time of
    a sparse iteration outside the exchange) and reports it as "hook_compute_time". The training
    loop spends 30 ms between steps and each exchange 100 ms more: the compute read is >= 30 ms
    and well below 130 ms (the exchange left out)."""
    hook, paced_step = _one_node_paced_loop(make_job, seed=3)

    def step():
        paced_step(0.03)  # the rest of the training loop (an optimizer, a data loader)

    for _ in range(3):
        step()
    assert hook.mode == "sparse", hook.failure
    assert hook.summary()["compute_s"] is None  # one sparse iteration: nothing to time yet
    hook._client = _WatchedClient(hook._client, slower_wait=0.1)
    for _ in range(12):
        step()
    s = hook.summary()
    assert s["mode"] == "sparse" and s["sparse_iterations"] == 13, s
    assert 0.03 <= s["compute_s"] < 0.1, s
    # The exchange was slow (12 of the 13 periods): it is in the step, not in the compute.
    assert s["mean_step_s"] >= s["compute_s"] + 0.08, s
    hook.close()


def test_one_pause_between_steps_is_not_the_trainers_compute_but_a_new_pace_is(group, make_job):
    """A loop that spends 20 ms between steps, and once evaluates for 0.4 s: that iteration's
    compute (> 4x the median of the last ones) is held back, not reported to the daemon. Two
    slow iterations in a row are the host's new pace: the second is reported."""
    hook, paced_step = _one_node_paced_loop(make_job, seed=4)

    def step(pause=0.02):
        paced_step(pause)

    for _ in range(3):
        step()
    assert hook.mode == "sparse", hook.failure
    hook._client = reports = _WatchedClient(hook._client)
    for _ in range(14):
        step()
    step(0.4)  # an evaluation
    for _ in range(4):
        step()
    sent = [v for name, v, _ in reports.metrics if name == "hook_compute_time"]
    assert len(sent) >= 15 and max(sent) < 0.2, sent
    held = hook.stats["compute_outliers_held"]
    assert held >= 1, dict(hook.stats)  # (a loaded host may hold back a stall of its own too)
    step(0.4)
    step(0.4)  # slower from here on
    step()
    sent = [v for name, v, _ in reports.metrics if name == "hook_compute_time"]
    assert max(sent) >= 0.4, sent
    assert hook.stats["compute_outliers_held"] == held + 1, dict(hook.stats)
    hook.close()


def test_the_step_controller_prices_the_trainer_by_the_hooks_timing(sparsecard, tmp_path):
    """Two nodes whose trainers report no compute time (ddp_digits.py without
    --report-compute-time): rank 0's step controller takes the hooks' "hook_compute_time" as the
    trainer's time of a step ("trainer N ms" in its model, logged every step at debug level);
    without it the model says 0 ms. It is the slowest node's, smoothed: within 4x of rank 0's
    own median."""
    out = tmp_path / "ddp.json"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "ddp_digits.py"), "--sparsecard", sparsecard,
                        "--pythonpath", os.environ.get("PYTHONPATH", ""), "--out", str(out),
                        "--methods", "sparsecar", "--nodes", "2", "--local-clients", "1", "--steps", "25",
                        "--compression", "on", "--density", "0.05", "--timeout", "120", "--keep-logs",
                        "--daemon-arg=--controller", "--daemon-arg=step",
                        "--daemon-arg=--log-level", "--daemon-arg=debug"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    kept = re.search(r"logs kept in (\S+)", r.stderr)
    assert kept, r.stderr
    sc = json.loads(out.read_text())["methods"]["sparsecar"]
    assert sc["hook_mode"] == "sparse", sc["hook_failure"]
    mine = sc["hook_compute_s"]
    assert mine is not None and mine > 0, sc
    try:
        with open(os.path.join(kept.group(1), "sparsecard-0.log"), errors="replace") as f:
            said = re.findall(r"step model: .*?trainer ([0-9.e+-]+) ms", f.read())
    finally:
        shutil.rmtree(kept.group(1), ignore_errors=True)
    assert said, "no step model in the log"
    trainer_s = float(said[-1]) / 1e3
    assert mine / 4 < trainer_s < mine * 4, (trainer_s, mine)
