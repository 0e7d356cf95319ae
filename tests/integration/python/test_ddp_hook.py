"""sparsecar.torch.register: the DDP comm hook. In-process tests use a 1-rank gloo group; the
multi-process test runs 4 DDP ranks through 2 daemons (bench/convergence/ddp_digits.py)."""
import json
import os
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import sparsecar.torch  # noqa: E402
from conftest import BENCH  # noqa: E402


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


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
    iteration and fall back, and their parameters stay bit-identical."""
    s = _ddp_digits(sparsecard, tmp_path,
                    ["--methods", "sparsecar", "--nodes", "2", "--local-clients", "1", "--steps", "12",
                     "--compression", "on", "--density", "0.05", "--on-error", "fallback",
                     "--daemon-step-timeout", "1", "--step-timeout", "20", "--timeout", "240"],
                    env_extra={"SPARSECAR_TEST_FAULTS": "drop=0.3,seed=3,kinds=1"})
    sc = s["methods"]["sparsecar"]
    assert sc["hook_mode"] == "fallback", sc
    assert sc["hook"]["failed_steps"] >= 1
    assert sc["ranks_identical"]
