"""Short form of the capped-link comparison (bench/convergence/capped.py): one rate (100 Mbit/s),
dense gloo vs sparsecar (fixed density), 100 steps. Checks the plumbing, not time to accuracy:
the tbf cap holds, both jobs run across the two namespaces, sparsecar puts far fewer bytes on the
link, and nothing the script created is left behind. Needs root and network namespaces (skipped
otherwise)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import BENCH


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


def test_capped_short(sparsecard, tmp_path):
    if not _can_netns():
        pytest.skip("needs root and network namespaces")
    out = tmp_path / "capped.json"
    p = subprocess.Popen([sys.executable, os.path.join(BENCH, "capped.py"), "--sparsecard", sparsecard,
                          "--pythonpath", os.environ.get("PYTHONPATH", ""), "--rates", "100mbit",
                          "--methods", "dense,sparsecar_static", "--steps", "100", "--eval-every", "20",
                          "--timeout", "120", "--out", str(out)],
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
