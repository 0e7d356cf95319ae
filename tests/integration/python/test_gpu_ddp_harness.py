"""The GPU DDP harness (bench/gpu/ddp_capped.py) on CPU: two network namespaces joined by a veth
capped at 100 Mbit/s, one gloo trainer each (the tiny 100k-parameter MLP), dense, PowerSGD and
sparsecar (daemons in the namespaces, UCX tcp on the veth) one after the other, 15 timed steps
each. Checks the plumbing the GPU run relies on: every method gives a step time, sparsecar ran
sparse and put fewer bytes on the link than dense, ratios are computed, nothing is left behind.
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


def test_harness_cpu_capped(sparsecard, tmp_path):
    if not _can_netns():
        pytest.skip("needs root and network namespaces")
    pytest.importorskip("torch")
    out = tmp_path / "ddp.json"
    p = subprocess.Popen([sys.executable, HARNESS, "--device", "cpu", "--models", "tiny", "--rates", "100mbit",
                          "--methods", "dense,powersgd,sparsecar", "--part", "step", "--steps", "15",
                          "--min-steps", "15", "--warmup", "3", "--threads", "1", "--kernel-threads", "1",
                          "--bin", os.path.dirname(sparsecard), "--pythonpath", os.environ.get("PYTHONPATH", ""),
                          "--run-timeout", "40", "--out-dir", str(tmp_path / "runs"), "--out", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = p.communicate(timeout=110)
    finally:
        if p.poll() is None:
            p.terminate()  # the harness tears its namespaces down on SIGTERM
            p.wait(timeout=30)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"sccap-{p.pid}-" not in left, "the harness left its namespaces behind"
    assert p.returncode == 0, log
    r = json.loads(out.read_text())
    assert r["links"]["100mbit"]["tcp_goodput_mbit"] <= 101, r["links"]
    runs = {e["method"]: e for e in r["runs"]}
    assert set(runs) == {"dense", "powersgd", "sparsecar"}, log
    for m, e in runs.items():
        assert e["status"] == "ok", (m, e.get("message"))
        assert e["steps_timed"] == 15 and e["step_ms"]["median"] > 0, e
        assert e["ratio_to_dense"] is not None and e["ratio_to_powersgd"] is not None
        assert e["link_bytes"] > 0
        assert e["params_identical"] is True, (m, "ranks ended with different parameters")
    sc, dense = runs["sparsecar"], runs["dense"]
    assert sc["hook"]["mode"] == "sparse" and sc["hook"]["failure"] is None, sc["hook"]
    assert 0 < sc["payload_bytes_per_step"] < dense["dense_ring_bytes_per_step"]
    assert sc["link_bytes"] < dense["link_bytes"], (sc["link_bytes"], dense["link_bytes"])
    assert "step time (cpu)" in log
