"""The GPU DDP harness (bench/gpu/ddp_capped.py) on CPU: two network namespaces joined by a veth
capped at 100 Mbit/s, one gloo trainer each (the tiny 100k-parameter MLP), dense, PowerSGD,
sparsecar and sparsecar_adaptive (daemons in the namespaces, UCX tcp on the veth) one after the
other, 15 timed steps each. Checks the plumbing the GPU run relies on: every method gives a step
time, sparsecar ran sparse and put fewer bytes on the link than dense, ratios are computed, the
adaptive run's daemon logged the hook's dense timing as the hook measured it, nothing is left
behind.
A second, shorter run takes --local-ranks 2: 2 nodes x 2 gloo trainers (world 4, two trainers
sharing each namespace and each daemon), sparsecar only (its first iterations are dense
all-reduces over the 4 processes), 3 timed steps: all 4 ranks end with identical parameters and
each daemon saw its 2 local clients connect.
Needs root, network namespaces and torch (skipped otherwise)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

HARNESS = os.path.join(ROOT, "bench", "gpu", "ddp_capped.py")


def _can_netns():
    if os.geteuid() != 0:
        return False
    name = f"sccap-probe-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        return False
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return True


def _harness(sparsecard, tmp_path, extra, timeout=150):
    """Runs the harness on CPU at 100mbit with `extra` options; returns (results, stdout)."""
    out = tmp_path / "ddp.json"
    p = subprocess.Popen([sys.executable, HARNESS, "--device", "cpu", "--models", "tiny", "--rates", "100mbit",
                          "--part", "step", "--threads", "1", "--kernel-threads", "1",
                          "--bin", os.path.dirname(sparsecard), "--pythonpath", os.environ.get("PYTHONPATH", ""),
                          "--run-timeout", "40", "--out-dir", str(tmp_path / "runs"), "--out", str(out)] + extra,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.terminate()  # the harness tears its namespaces down on SIGTERM
            p.wait(timeout=30)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"sccap-{p.pid}-" not in left, "the harness left its namespaces behind"
    assert p.returncode == 0, log
    return json.loads(out.read_text()), log


def test_harness_cpu_capped(sparsecard, tmp_path):
    if not _can_netns():
        pytest.skip("needs root and network namespaces")
    pytest.importorskip("torch")
    r, log = _harness(sparsecard, tmp_path, ["--methods", "dense,powersgd,sparsecar,sparsecar_adaptive", "--steps", "15",
                                             "--min-steps", "15", "--warmup", "3"])
    assert r["links"]["100mbit"]["tcp_goodput_mbit"] <= 101, r["links"]
    runs = {e["method"]: e for e in r["runs"]}
    assert set(runs) == {"dense", "powersgd", "sparsecar", "sparsecar_adaptive"}, log
    for m, e in runs.items():
        assert e["status"] == "ok", (m, e.get("message"))
        assert e["steps_timed"] == 15 and e["step_ms"]["median"] > 0, e
        assert e["ratio_to_dense"] is not None and e["ratio_to_powersgd"] is not None
        assert e["link_bytes"] > 0
        assert e["params_identical"] is True, (m, "ranks ended with different parameters")
        assert e["local_ranks"] == 1 and e["world"] == 2 and e["params_checked_ranks"] == 2, e
    sc, dense = runs["sparsecar"], runs["dense"]
    assert sc["hook"]["mode"] == "sparse" and sc["hook"]["failure"] is None, sc["hook"]
    for m in ("sparsecar", "sparsecar_adaptive"):  # the harness's default: the hook takes the SGD momentum over
        assert runs[m]["hook"]["momentum_correction"] == 0.9, (m, runs[m]["hook"])
    assert sc["daemon_local_clients"] == [{"expected": 1, "connected": 1}] * 2, sc["daemon_local_clients"]
    assert 0 < sc["payload_bytes_per_step"] < dense["dense_ring_bytes_per_step"]
    assert sc["link_bytes"] < dense["link_bytes"], (sc["link_bytes"], dense["link_bytes"])
    assert "step time (cpu; 2 nodes x 1 local rank = world 2)" in log
    # The adaptive run: the daemons ran the controllers' default, and rank 0's daemon got the
    # hook's last dense iteration before its first step, as the hook measured it (the log has 3
    # significant digits in ms).
    ad = runs["sparsecar_adaptive"]
    assert "schedule,step" in ad["daemon_flags"] and ad["hook"]["mode"] == "sparse", ad
    hint, hook = ad["start_hint"], ad["hook"]
    assert hint is not None and hint["step"] == 2, (hint, log)
    assert 0 <= hint["dense_wait_ms"] < hint["dense_step_ms"], hint
    assert hint["dense_step_ms"] == pytest.approx(hook["dense_step_s"] * 1e3, rel=6e-3), (hint, hook)
    assert hint["dense_wait_ms"] == pytest.approx(hook["dense_wait_s"] * 1e3, rel=6e-3, abs=1e-3), (hint, hook)


def test_harness_cpu_two_local_ranks(sparsecard, tmp_path):
    if not _can_netns():
        pytest.skip("needs root and network namespaces")
    pytest.importorskip("torch")
    r, log = _harness(sparsecard, tmp_path, ["--local-ranks", "2", "--methods", "sparsecar", "--steps", "3",
                                             "--min-steps", "3", "--warmup", "3", "--no-momentum-correction"],
                      timeout=80)
    assert r["topology"] == {"nodes": 2, "local_ranks": 2, "world": 4, "gpus": None}, r["topology"]
    [e] = r["runs"]
    assert e["status"] == "ok", e.get("message")
    assert e["local_ranks"] == 2 and e["world"] == 4
    ranks = e["ranks"]
    # global rank = node * 2 + local; every trainer in a world of 4; node values for the hook
    assert [(x["rank"], x["world"], x["node"], x["local_rank"]) for x in ranks] == [
        (0, 4, 0, 0), (1, 4, 0, 1), (2, 4, 1, 0), (3, 4, 1, 1)], ranks
    assert all(x["params_identical"] is True for x in ranks)
    assert len({x["params_sha256"] for x in ranks}) == 1, "the 4 ranks ended with different parameters"
    assert e["params_identical"] is True and e["params_checked_ranks"] == 4
    for x in ranks:
        assert x["hook"]["mode"] == "sparse" and x["hook"]["failure"] is None, x["hook"]
        assert x["hook"]["sparse_iterations"] >= 3, x["hook"]
        assert x["hook"]["momentum_correction"] is None, x["hook"]  # --no-momentum-correction: the trainers' own
    # each node's daemon was started for 2 local clients and both of its trainers connected
    assert e["daemon_local_clients"] == [{"expected": 2, "connected": 2}] * 2, e["daemon_local_clients"]
    for node in range(2):
        with open(os.path.join(e["log_dir"], f"sparsecard-{node}.log")) as f:
            assert "2 of 2 local clients" in f.read()
    assert "2 nodes x 2 local ranks = world 4" in log
    assert "parameters identical on all 4 ranks" in log
