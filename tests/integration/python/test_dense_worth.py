"""bench/controllers/dense_worth.py, the in-process simulation of the real jobs' training that
counts what a dense step is worth in steps: its plan grammar, and two facts that hold by
construction whatever the model learns, so they check the simulation itself: top-k keeping every
element (density 1) with error feedback is the dense average, and a plan that starts dense
trains exactly as dense until it switches. Seconds (one small seed, tens of steps)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench", "controllers"))

import dense_worth  # noqa: E402

TOOL = os.path.join(ROOT, "bench", "controllers", "dense_worth.py")


def test_plans_parse_and_the_last_segment_holding_a_step_wins():
    plan = dense_worth.parse_plan("dense:0-40,topk:40-,dense:100-120")
    assert plan == [("dense", 0, 40), ("topk", 40, None), ("dense", 100, 120)]
    assert [dense_worth.kind_at(plan, s) for s in (0, 39, 40, 99, 100, 119, 120)] == \
        ["dense", "dense", "topk", "topk", "dense", "dense", "topk"]
    assert dense_worth.kind_at(dense_worth.parse_plan("dense:10-20"), 5) == "topk"  # no segment: top-k
    # Without a range a segment goes on from where the one before it ended.
    assert dense_worth.parse_plan("dense:0-40,topk") == [("dense", 0, 40), ("topk", 40, None)]
    assert dense_worth.parse_plan("topk") == [("topk", 0, None)]
    # topkP: top-k of P % of the elements; plain topk is --density's.
    assert dense_worth.parse_plan("dense:0-10,topk2") == [("dense", 0, 10), ("topk2", 10, None)]
    assert dense_worth.segment_density("topk2") == pytest.approx(0.02)
    assert dense_worth.segment_density("topk", 0.005) == 0.005
    assert dense_worth.segment_density("dense") is None


@pytest.mark.parametrize("bad", ["ring", "dense:5-5", "dense:9-3", "dense:x-4", "dense:-1-4", "", "topk0",
                                 "topk101", "topkx"])
def test_bad_plans_are_refused_with_a_message(bad):
    with pytest.raises(SystemExit) as e:
        dense_worth.parse_plan(bad)
    assert "--plan" in str(e.value)


def test_bad_seeds_are_refused():
    assert dense_worth.parse_seeds("2-4") == [2, 3, 4]
    for bad in ("0", "4-2", "a"):
        with pytest.raises(SystemExit):
            dense_worth.parse_seeds(bad)


def run(tmp_path, *args):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, TOOL, "--steps", "30", "--eval-every", "5", "--seeds", "1",
                        "--out", str(out), *args], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    return json.loads(out.read_text())["seeds"]["1"]["runs"], p.stdout


def test_top_k_of_every_element_is_the_dense_average(tmp_path):
    runs, stdout = run(tmp_path, "--density", "1")
    dense, topk = runs["dense"]["curve"], runs["topk"]["curve"]
    assert len(dense) == 6
    # Float sums in another order (per node first) may move an accuracy by an image at most.
    assert all(d[0] == t[0] and abs(d[1] - t[1]) < 0.005 for d, t in zip(dense, topk))
    stats = runs["topk"]["topk_statistics"]
    assert stats and all(s["residual_over_grad"] < 1e-9 and s["kept"] > 1 - 1e-6 for s in stats)
    assert "| topk |" in stdout


def test_a_plan_that_starts_dense_trains_as_dense_until_it_switches(tmp_path):
    runs, _ = run(tmp_path, "--plan", "dense:0-15,topk")
    dense, plan, topk = runs["dense"]["curve"], runs["dense:0-15,topk"]["curve"], runs["topk"]["curve"]
    assert [p for p in plan if p[0] <= 15] == [d for d in dense if d[0] <= 15]
    # 0.5 % top-k from step 2 is another training: its curve leaves dense's (the check can fail).
    assert [t for t in topk if t[0] <= 15] != [d for d in dense if d[0] <= 15]


def test_the_residual_at_a_switch_to_dense_is_flushed_dropped_or_kept(tmp_path):
    """--switch-residual: dense steps never read the residual, so one dropped at the switch and
    one kept for later train alike through the dense stretch and part once top-k runs again;
    one flushed (the daemons' way) is sent with the first dense step, another update at once."""
    plan = "topk:0-10,dense:10-20,topk"
    curves = {w: run(tmp_path, "--plan", plan, "--switch-residual", w)[0][plan]["curve"]
              for w in ("flush", "drop", "keep")}
    upto = lambda c, a, b: [p for p in c if a < p[0] <= b]  # noqa: E731
    assert upto(curves["drop"], 0, 20) == upto(curves["keep"], 0, 20)
    assert upto(curves["drop"], 20, 30) != upto(curves["keep"], 20, 30)
    assert upto(curves["flush"], 0, 10) == upto(curves["drop"], 0, 10)
    assert upto(curves["flush"], 10, 20) != upto(curves["drop"], 10, 20)


def test_the_time_model_charges_each_step_the_phase_it_starts_in():
    costs = dense_worth.parse_step_ms("dense=24/90,topk=19")
    assert costs == {"dense": (24.0, 90.0), "topk": (19.0, 19.0)}
    dense = [("dense", 0, None)]
    assert dense_worth.seconds_to(dense, 10, costs, 4.0) == pytest.approx(0.240)  # all in the first phase
    # Phases of 0.1 s: steps start at 0, 24, 48, 72, 96 ms (fast), the 6th at 120 ms (slow, 90 ms).
    assert dense_worth.seconds_to(dense, 6, costs, 0.1) == pytest.approx(0.210)
    # The hook's first 2 iterations are dense in a top-k plan too: 2 x 24 + 3 x 19 ms.
    assert dense_worth.seconds_to([("topk", 0, None)], 5, costs, 4.0) == pytest.approx(0.105)
    # A topkP kind without its own entry costs what topk does.
    assert dense_worth.seconds_to(dense_worth.parse_plan("dense:0-2,topk2"), 3, costs, 4.0) == pytest.approx(0.067)


def test_the_time_model_of_a_rate_that_changes_once_holds_the_second_rate_to_the_end():
    costs = dense_worth.parse_step_ms("dense=24/90,topk=19")
    dense = [("dense", 0, None)]
    # Steps start at 0, 24, 48, 72, 96 ms (fast), 120 (slow) and 210 ms: alternating every 0.1 s
    # the 7th is fast again, 24 ms; changing once it stays slow, 90 ms.
    assert dense_worth.seconds_to(dense, 7, costs, 0.1) == pytest.approx(0.234)
    assert dense_worth.seconds_to(dense, 7, costs, 0.1, once=True) == pytest.approx(0.300)


def test_plans_are_paired_per_seed_over_the_seeds_both_reached():
    times = {"dense": [2.0, 4.0, None], "topk": [1.0, 1.0, 1.0], "x": [1.0, 2.0, 3.0]}
    # x over dense: 0.5 and 0.5 (the third seed has no dense time): no spread, a point interval.
    assert dense_worth.paired_text(times, "x", "dense") == "0.500 [0.500-0.500] over 2"
    assert dense_worth.paired_text({"a": [1.0, None], "b": [2.0, 1.0]}, "a", "b") == "0.500 over 1"
    assert dense_worth.paired_text(times, "topk", "topk") == "-"
    # x over topk: 1, 2, 3: geometric mean 6^(1/3) = 1.817, and an interval around it.
    text = dense_worth.paired_text(times, "x", "topk")
    assert text.startswith("1.817 [") and text.endswith("] over 3")


@pytest.mark.parametrize("bad", ["dense=24", "topk=19", "dense=24,topk=x", "dense=0,topk=19", "dense=1/2/3,topk=1",
                                 "ring=3,dense=1,topk=1"])
def test_bad_time_models_are_refused(bad):
    with pytest.raises(SystemExit) as e:
        dense_worth.parse_step_ms(bad)
    assert "--step-ms" in str(e.value)
