"""README's single-host quick start, verbatim: examples/quickstart/run.sh with this build's
binaries on free ports. Two daemons, a DDP job through torch's launcher (one per node),
sparsecarctl status against each daemon, Prometheus scraping both (when installed)."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from ports import free_ports  # noqa: E402  (tests/integration/ports.py)


def test_quickstart_runs_end_to_end(sparsecard, tmp_path):
    ctl = os.environ.get("SPARSECARCTL")
    if not ctl:
        pytest.skip("SPARSECARCTL (path of the sparsecarctl binary) is not set")
    coordinator, master, metrics_0, metrics_1, prometheus = free_ports(5)
    env = dict(os.environ, SPARSECARD=sparsecard, SPARSECARCTL=ctl, QUICKSTART_DIR=str(tmp_path / "qs"),
               COORDINATOR_PORT=str(coordinator), MASTER_PORT=str(master),
               METRICS_PORT_0=str(metrics_0), METRICS_PORT_1=str(metrics_1),
               PROMETHEUS_PORT=str(prometheus), STEPS="20", PYTHON=os.environ.get("PYTHON", "/usr/bin/python3"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "SPARSECAR_SOCKET",
              "SPARSECAR_CONTROL", "SPARSECAR_COORDINATOR", "SPARSECAR_NODE_RANK", "SPARSECAR_NNODES"):
        env.pop(k, None)
    env.setdefault("UCX_TLS", "tcp")
    env.setdefault("UCX_NET_DEVICES", "lo")
    env["JOB_TIMEOUT"] = "180"
    # Its own session: if it overruns, everything it started goes with it.
    p = subprocess.Popen([os.path.join(ROOT, "examples", "quickstart", "run.sh")], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail("the quick start ran past 240 s:\n" + out)
    assert p.returncode == 0, out
    assert "quickstart: done" in out
    # The job finished: the trainer's last line and the hook's start line and summary (rank 0).
    launcher = (tmp_path / "qs" / "launcher-0.log").read_text()
    assert re.search(r"train_ddp: 2 ranks, 20 steps", launcher), launcher
    assert "sparsecar: rank 0 of 2: 4 parameter tensors" in launcher and "node 0 of 2" in launcher, launcher
    m = re.search(r"sparsecar DDP hook: sparse, 20 iterations .*ratio [0-9.]+x, density ([0-9.]+)", launcher)
    assert m, launcher
    # The quick start's '*.bias: compression=off' reached the DDP job's bias tensors: 68 of its
    # 2372 elements go dense, the weights at 0.05 -> about 0.077 (0.05 without the override).
    assert 0.07 < float(m.group(1)) < 0.085, m.group(0)
    # Both daemons report the job's steps (also checked by the script itself).
    for node in (0, 1):
        s = json.loads((tmp_path / "qs" / f"status-{node}.json").read_text())
        s = s.get("result", s)
        assert s["clients"]["steps_completed"] > 0, s
        assert s["rank"] == node and s["world_size"] == 2
    if shutil.which("prometheus"):
        assert len(re.findall(r"quickstart: prometheus: 127\.0\.0\.1:\d+ sparsecar_steps_total", out)) == 2, out
    # Nothing left running: no daemon accepts on the trainer sockets any more.
    for sock in (tmp_path / "qs").glob("node?.sock"):
        with socket.socket(socket.AF_UNIX) as c, pytest.raises(OSError):
            c.connect(str(sock))
