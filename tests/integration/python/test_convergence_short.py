"""Short forms of the convergence evidence (bench/convergence/) with the issue's acceptance checks."""
import json
import os
import subprocess
import sys


from conftest import BENCH


def run(script, args, timeout):
    r = subprocess.run([sys.executable, os.path.join(BENCH, script)] + args, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_paper_logreg_short(tmp_path):
    out = tmp_path / "paper.json"
    run("paper_logreg.py", ["--short", "--pythonpath", os.environ.get("PYTHONPATH", ""), "--out", str(out)], 300)
    s = json.loads(out.read_text())
    e, b = s["epochs_to_target"], s["bits_to_target"]
    assert all(b[m] is not None for m in ("dense", "topk", "threshold")), s["final_suboptimality"]
    # hard-threshold converges about as fast as dense SGD per epoch ...
    assert e["threshold"] <= e["dense"] + 0.5
    # ... keeps a smaller error-feedback residual than top-k (the paper's Figure 1c) ...
    assert s["max_error_norm"]["threshold"] < s["max_error_norm"]["topk"]
    # ... and both sparsifiers send a small fraction of dense SGD's bits
    assert s["threshold_bits"] * 20 < s["dense_bits"] and s["topk_bits"] * 100 < s["dense_bits"]


def test_ddp_digits_short(sparsecard, tmp_path):
    out = tmp_path / "ddp.json"
    # The evidence of docs/convergence.md: top-k over each flat DDP bucket. (Per parameter, the
    # hook's default, ends 0.9 pp below dense here: docs/convergence.md, "Not done yet".)
    run("ddp_digits.py", ["--sparsecard", sparsecard, "--pythonpath", os.environ.get("PYTHONPATH", ""),
                          "--steps", "400", "--out", str(out), "--timeout", "400", "--hook-tensors", "buckets"], 450)
    s = json.loads(out.read_text())["methods"]
    dense, sc, ps = s["dense"], s["sparsecar"], s["powersgd"]
    assert sc["hook_mode"] == "sparse" and sc["hook"].get("failed_steps", 0) == 0
    assert sc["accuracy"] >= dense["accuracy"] - 0.005, (sc["accuracy"], dense["accuracy"])
    assert dense["bytes"] >= 50 * sc["bytes"], (dense["bytes"], sc["bytes"])
    assert ps["accuracy"] > 0.9
    for m in (dense, sc, ps):
        assert m["rank_checksum_spread"] == 0.0  # every rank ends with the same model
