"""sparsecar.Client against real daemons: round trips (NumPy and torch), zero-copy views,
errors as exceptions with the daemon's message."""
import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import sparsecar
from conftest import ROOT


def test_round_trip_two_nodes_exact_mean(make_job):
    job = make_job(nodes=2, daemon_args=["--compression", "off"])
    clients = [sparsecar.Client(s, timeout=10) for s in job.sockets]
    tensors = [c.register("w", (4, 25)) for c in clients]
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal((4, 25)).astype(np.float32) for _ in clients]
    expect = (grads[0] + grads[1]) * np.float32(0.5)
    infos = [None, None]

    def node(r):  # each node's trainer in its own thread: the GIL is released while waiting
        infos[r] = clients[r].allreduce(tensors[r], grads[r], step=1, lr=0.1)

    threads = [threading.Thread(target=node, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for r in range(2):
        assert infos[r] is not None and infos[r].step == 1 and infos[r].dense_bytes > 0
    np.testing.assert_array_equal(grads[0], expect)  # compression off: the exact mean
    np.testing.assert_array_equal(grads[1], expect)
    a = tensors[0].array()
    assert a.shape == (4, 25) and a.dtype == np.float32
    np.testing.assert_array_equal(a, grads[0])
    for c in clients:
        c.close()


def test_topk_torch_zero_copy_and_metrics(make_job):
    torch = pytest.importorskip("torch")
    job = make_job(nodes=2, daemon_args=["--compression", "on", "--selector", "topk", "--density", "0.1"])
    clients = [sparsecar.Client(s) for s in job.sockets]
    ts = [c.register("g", 100) for c in clients]
    views = [sparsecar.as_torch(t) for t in ts]
    assert views[0].data_ptr() == ts[0].array().ctypes.data  # same memory, no copy
    g = [torch.zeros(100), torch.zeros(100)]
    g[0][7], g[1][42] = 5.0, -3.0
    for r in range(2):
        clients[r].submit(ts[r], 1, lr=0.5, data=g[r])
    infos = [clients[r].wait(ts[r], 1, timeout=30, out=g[r]) for r in range(2)]
    for r in range(2):
        assert infos[r].nnz == 10
        assert g[r][7] == pytest.approx(2.5) and g[r][42] == pytest.approx(-1.5)
        assert float(views[r].abs().sum()) == pytest.approx(4.0)
        assert infos[r].bytes_sent < infos[r].dense_bytes
        clients[r].report_metric("loss", 0.25, 1)
    for c in clients:
        c.close()
    assert clients[0].closed


def test_errors_are_exceptions(make_job, tmp_path):
    with pytest.raises(sparsecar.Unavailable) as e:
        sparsecar.Client(str(tmp_path / "nobody.sock"), timeout=0.2)
    assert e.value.code_name == "UNAVAILABLE" and "nobody.sock" in str(e.value)
    assert isinstance(e.value, ConnectionError) and isinstance(e.value, sparsecar.Error)

    job = make_job(nodes=1)
    c = sparsecar.Client(job.sockets[0])
    t = c.register("w", 8)
    with pytest.raises(sparsecar.Error) as e:
        c.wait(t, 5, timeout=0.1)
    assert e.value.code_name == "FAILED_PRECONDITION"
    with pytest.raises(ValueError):
        c.submit(t, 1, data=np.zeros(9, dtype=np.float32))
    with pytest.raises(TypeError):  # in-place kernels refuse a copy-converting dtype
        sparsecar.kernels.ef_accumulate(np.zeros(4), np.zeros(4, dtype=np.float32))
    c.close()
    with pytest.raises(ValueError):
        c.register("x", 4)


def test_selector_registry_is_listed_and_runs_by_name():
    rows = sparsecar.kernels.selectors()
    assert [r["id"] for r in rows] == list(range(len(rows)))
    names = [r["name"] for r in rows]
    assert names[:3] == ["none", "topk", "threshold"] and "randomk" in names
    assert next(r for r in rows if r["name"] == "randomk")["unbiased"] is True
    assert "density" in next(r for r in rows if r["name"] == "topk")["params"]
    x = np.array([0.5, -3.0, 0.1, 2.0, -0.2], dtype=np.float32)
    idx, val = sparsecar.kernels.select("topk", x, density=0.4)
    assert list(idx) == [1, 3] and list(val) == [-3.0, 2.0]
    idx, val = sparsecar.kernels.select("threshold", x, threshold=0.4)
    assert list(idx) == [0, 1, 3]
    with pytest.raises(ValueError):
        sparsecar.kernels.select("no_such_selector", x)


def test_daemon_deadline_comes_through_wait_unchanged(make_job):
    """The daemon's DEADLINE_EXCEEDED ("rank 1 did not deliver ...") used to be retried by wait()'s
    slices and turned into FAILED_PRECONDITION "step was not submitted"."""
    job = make_job(nodes=2, daemon_args=["--compression", "off", "--step-timeout-ms", "500"])
    clients = [sparsecar.Client(s, timeout=10) for s in job.sockets]
    tensors = [c.register("w", 8) for c in clients]
    for r in range(2):  # the first step agrees on the job (join timeout); it must succeed
        clients[r].submit(tensors[r], 1, data=np.ones(8, dtype=np.float32))
    for r in range(2):
        clients[r].wait(tensors[r], 1, timeout=30)
    clients[0].submit(tensors[0], 2, data=np.ones(8, dtype=np.float32))  # rank 1 never submits 2
    with pytest.raises(sparsecar.DeadlineExceeded) as e:
        clients[0].wait(tensors[0], 2, timeout=20)
    assert e.value.code_name == "DEADLINE_EXCEEDED"
    assert "did not deliver" in str(e.value) and "rank 1" in str(e.value), str(e.value)
    # A wait that itself runs out still says so, and the step stays waitable.
    clients[0].submit(tensors[0], 3, data=np.ones(8, dtype=np.float32))
    with pytest.raises(sparsecar.DeadlineExceeded) as e:
        clients[0].wait(tensors[0], 3, timeout=0.05)
    assert "not completed within" in str(e.value), str(e.value)
    with pytest.raises(sparsecar.DeadlineExceeded) as e:
        clients[0].wait(tensors[0], 3, timeout=20)
    assert "did not deliver" in str(e.value), str(e.value)
    for c in clients:
        c.close()


def test_device_registration_refused_without_gpu_and_checked_here(make_job):
    """This machine has no GPU: the daemon refuses a device tensor with Unavailable saying why,
    the session stays usable for the host fallback, and bad handle lengths never leave Python."""
    job = make_job(nodes=1)
    c = sparsecar.Client(job.sockets[0], timeout=10)
    handles = dict(device_uuid=bytes(16), mem_handle=bytes(64), offset=0, ready_event=bytes(64),
                   done_event=bytes(64))
    with pytest.raises(ValueError, match="mem_handle .* must be 64 bytes, got 3"):
        c.register_device("g", 8, **dict(handles, mem_handle=b"abc"))
    with pytest.raises(ValueError, match="device_uuid .* must be 16 bytes"):
        c.register_device("g", 8, **dict(handles, device_uuid=bytes(15)))
    with pytest.raises(sparsecar.Unavailable) as refused:
        c.register_device("g", 8, **handles)
    assert refused.value.code_name == "UNAVAILABLE"
    assert "GPU" in str(refused.value) or "CUDA" in str(refused.value)
    t = c.register("g", 8)  # the fallback the DDP hook takes
    assert not t.on_device
    c.allreduce(t, np.full(8, 3.0, dtype=np.float32), step=1)
    c.close()


def test_device_handles_refuses_cpu_tensors():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="not a CUDA device"):
        sparsecar.device_handles(torch.zeros(4), None, None)
    with pytest.raises(TypeError):
        sparsecar.device_handles([1.0], None, None)


def test_ipc_mem_handle_formats():
    """torch's shareable CUDA handle: 64 bytes as they are (torch <= 2.1); 66 bytes = version byte +
    kind b"c" + the cudaIpcMemHandle_t (later torch); expandable segments and unknown formats are
    refused with a message saying what to do."""
    handle = bytes(range(64))
    assert sparsecar._ipc_mem_handle(handle) == handle
    assert sparsecar._ipc_mem_handle(b"\x01c" + handle) == handle
    with pytest.raises(ValueError, match="expandable"):
        sparsecar._ipc_mem_handle(b"\x01e" + bytes(80))
    with pytest.raises(ValueError, match="format"):
        sparsecar._ipc_mem_handle(b"\x01x" + handle)
    with pytest.raises(ValueError, match="format"):
        sparsecar._ipc_mem_handle(handle[:40])


def test_step_controller_times_small_messages_on_the_receivers_and_prices_the_step(make_job):
    """--controller step: the nodes' data sends go rendezvous, the receivers time them (a sparse
    message here is ~2 KB: without this it would go eagerly and give no sample), rank 0 fits the
    link from the samples in the observations and says what it priced — in JSON and in text."""
    ctl = os.environ.get("SPARSECARCTL")
    if not ctl:
        pytest.skip("SPARSECARCTL (path of the sparsecarctl binary) is not set")
    job = make_job(nodes=2, daemon_args=["--controller", "step", "--density", "0.01"])
    clients = [sparsecar.Client(s, timeout=20) for s in job.sockets]
    tensors = [c.register("w", 20_000) for c in clients]
    rng = np.random.default_rng(3)

    def node(r, step):
        g = rng.standard_normal(20_000).astype(np.float32) if r == 0 else np.ones(20_000, np.float32)
        clients[r].allreduce(tensors[r], g, step=step, lr=0.1)
        clients[r].report_metric("compute_time", 0.005, step)

    def status():
        r = subprocess.run([ctl, "--endpoint", f"ipc://{job.dir}/control-0.sock", "--json", "status"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stdout + r.stderr
        s = json.loads(r.stdout)
        return s.get("result", s)["controllers"]

    step = 0
    deadline = time.monotonic() + 60
    while True:
        step += 1
        threads = [threading.Thread(target=node, args=(r, step)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        c = status()
        if "(slowest of 2," in (c["step_model"] or "") and c["steps_observed"] >= 5:
            break
        assert time.monotonic() < deadline, c
    assert c["active"] == "step", c
    # Both directions fitted (the rate is what the samples say: with one message size, the
    # per-message latency of a loaded box counts as time per byte); the trainer's 5 ms is priced.
    m = re.match(r"links: alpha ([0-9.e+-]+) ms, ([0-9.e+-]+) MB/s \(slowest of 2,", c["step_model"])
    assert m, c["step_model"]
    assert 0 <= float(m.group(1)) < 1000 and float(m.group(2)) > 0, c["step_model"]
    assert "trainer 5 ms" in c["step_model"], c["step_model"]
    assert c["predicted_step_s"] > 0.005, c
    r = subprocess.run([ctl, "--endpoint", f"ipc://{job.dir}/control-0.sock", "status"],
                       capture_output=True, text=True, timeout=30)
    assert "step model: links: alpha" in r.stdout, r.stdout
    for cl in clients:
        cl.close()


def test_the_submit_while_waiting_benchmark_runs(sparsecard):
    """bench/client/submit_while_waiting.py, a few steps: both rows of its table, with numbers."""
    script = os.path.join(ROOT, "bench", "client", "submit_while_waiting.py")
    r = subprocess.run([sys.executable, script, "--sparsecard", sparsecard, "--steps", "3", "--delay-ms", "5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith(("baseline", "another thread"))]
    assert len(rows) == 2, r.stdout
    for row in rows:
        assert re.search(r"\d+\.\d{3}\s+\d+\.\d{3}\s+\d+\.\d{3}\s+\d+\.\dx$", row), row
    bad = subprocess.run([sys.executable, script, "--sparsecard", sparsecard, "--steps", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--steps" in bad.stderr, bad.stderr
