"""Short form of the capped-link comparison (bench/convergence/capped.py): one rate (100 Mbit/s),
dense gloo vs sparsecar (fixed density), 100 steps. Checks the plumbing, not time to accuracy:
the tbf cap holds, both jobs run across the two namespaces, sparsecar puts far fewer bytes on the
link, and nothing the script created is left behind. Needs root and network namespaces (skipped
otherwise)."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import BENCH, ROOT

sys.path.insert(0, os.path.join(ROOT, "bench", "controllers"))
import real_metrics as rm  # noqa: E402  (the job-end line of the link probes)


def _can_netns():
    if os.geteuid() != 0:
        return False
    name = f"sccap-probe-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        return False
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return True


def _our_namespaces(pid):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.startswith(f"sccap-{pid}-")]


def _capped(sparsecard, out, *args):
    """capped.py's command line (skips the test without root and network namespaces)."""
    if not _can_netns():
        pytest.skip("needs root and network namespaces")
    return [sys.executable, os.path.join(BENCH, "capped.py"), "--sparsecard", sparsecard,
            "--pythonpath", os.environ.get("PYTHONPATH", ""), "--out", str(out), *args]


def test_capped_short(sparsecard, tmp_path):
    out = tmp_path / "capped.json"
    p = subprocess.Popen(_capped(sparsecard, out, "--rates", "100mbit", "--methods", "dense,sparsecar_static",
                                 "--steps", "100", "--eval-every", "20", "--timeout", "120"),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.terminate()  # capped.py tears down its namespaces on SIGTERM
            p.wait(timeout=30)
    assert not _our_namespaces(p.pid), "capped.py left its namespaces behind"
    assert p.returncode == 0, log
    r = json.loads(out.read_text())["100mbit"]
    assert 80 <= r["link"]["tcp_goodput_mbit"] <= 101, r["link"]  # the cap holds
    dense, sc = r["dense"], r["sparsecar_static"]
    assert sc["hook_mode"] == "sparse" and sc["hook_failure"] is None
    assert len(dense["curve"]) == 5 and len(sc["curve"]) == 5
    assert dense["final_accuracy"] > 0.8
    # sparsecar's 98 compressed steps are tiny next to 100 dense gloo all-reduces over the link
    assert sc["bytes"] * 10 < dense["bytes"], (sc["bytes"], dense["bytes"])


def test_the_link_probe_crosses_a_capped_link(sparsecard, tmp_path):
    """The default adaptive setting (the 6-step dense warm-up, then top-k 0.5 %) over a 50 Mbit/s
    tbf link: the ring costs many sparse steps there, so the sparse plan runs, and 1 s into it each
    daemon sends its ring successor link probes of the bytes the ring would send it in a step (the
    digits MLP's one ~85 k-element bucket: 2 chunks of ~170 KB over 2 nodes) across the shaped
    link, and the other validates and drops them (both logged at debug level; step_probe_share 0.5
    so that several fit in the job). The job's steps are not disturbed."""
    out = tmp_path / "capped.json"
    r = subprocess.run(_capped(sparsecard, out, "--rates", "50mbit", "--methods", "dense,sparsecar",
                               "--controller", "schedule,step", "--steps", "200", "--eval-every", "50",
                               "--timeout", "180", "--keep-logs", "--daemon-arg=--schedule-warmup-steps=6",
                               "--daemon-arg=--step-probe-share=0.5", "--daemon-arg=--log-level=debug"),
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    kept = re.findall(r"logs kept in (\S+)", r.stderr)  # the dense job's, then sparsecar's
    assert len(kept) == 2, r.stderr[-3000:]
    logs = {}
    try:
        for rank in (0, 1):
            with open(os.path.join(kept[-1], f"sparsecard-{rank}.log"), errors="replace") as f:
                logs[rank] = f.read()
    finally:
        for d in kept:
            shutil.rmtree(d, ignore_errors=True)
    sc = json.loads(out.read_text())["50mbit"]["sparsecar"]
    assert sc["hook_mode"] == "sparse", sc.get("hook_failure")
    sent = {rank: re.findall(r"link probe \d+ at step (\d+): (\d+) bytes to rank (\d+)", logs[rank]) for rank in (0, 1)}
    got = {rank: re.findall(r"link probe from rank (\d+): (\d+) bytes", logs[rank]) for rank in (0, 1)}
    sizes = {int(b) for rank in (0, 1) for _, b, _ in sent[rank]}
    # One size: the ring's step for the one bucket (2 chunks of half its elements, 4 bytes each).
    assert len(sizes) == 1 and 64 * 1024 <= min(sizes) <= 4 * 1024 * 1024, sent
    for rank in (0, 1):
        assert sent[rank], f"rank {rank} sent no probe"
        assert got[rank], f"rank {rank} received no probe"
        assert all(int(to) == 1 - rank for _, _, to in sent[rank]), sent[rank]
        assert all(int(frm) == 1 - rank and int(b) in sizes for frm, b in got[rank]), got[rank]
        # The job-end line (INFO; what bench/controllers/real.py reports) holds the same probes.
        summary = rm.parse_probes(logs[rank].splitlines())
        assert summary["sent"] == len(sent[rank]) and summary["to"] == 1 - rank, (summary, sent[rank])
        assert summary["steps"] == [int(s) for s, _, _ in sent[rank]][:32], (summary, sent[rank])
