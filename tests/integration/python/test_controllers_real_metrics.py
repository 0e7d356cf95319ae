"""The arithmetic of `scripts/bench controllers --real` (bench/controllers/real_metrics.py) on
small hand-made curves, step times and decision logs: time to accuracy, the gap below the dense
curve, rate changes mapped to steps, decisions attributed to a change's settle window or to a
steady rate, and issue 14's checks. No processes, no root; well under a second."""
import math
import os
import subprocess
import sys
import time

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench", "controllers"))

import real_metrics as rm  # noqa: E402
from localjob import cpu_seconds, cpu_seconds_of_stat  # noqa: E402  (each daemon's CPU per job)

DENSE = [[10, 1.0, 0.50], [20, 2.0, 0.80], [30, 3.0, 0.90], [40, 4.0, 0.95]]


def test_time_to_accuracy_is_the_first_evaluation_at_or_above_the_target():
    curve = [[10, 0.5, 0.60], [20, 1.1, 0.951], [30, 1.6, 0.94], [40, 2.2, 0.96]]
    assert rm.time_to_accuracy(curve, 0.95) == (1.1, 20)
    assert rm.time_to_accuracy(DENSE, 0.95) == (4.0, 40)        # dense reaches its own final value
    assert rm.time_to_accuracy(curve, 0.97) == (None, None)
    assert rm.time_to_accuracy([], 0.5) == (None, None)


def test_gap_to_dense_is_the_largest_shortfall_at_shared_steps():
    curve = [[10, 0.4, 0.52], [20, 0.8, 0.72], [30, 1.2, 0.89], [50, 2.0, 0.10]]  # step 50: no dense point
    gap, at = rm.gap_to_dense(DENSE, curve)
    assert abs(gap - 8.0) < 1e-9 and at == 20                  # 0.80 - 0.72
    gap, at = rm.gap_to_dense(DENSE, [[10, 0.1, 0.60], [40, 0.4, 0.99]])
    assert abs(gap - (-4.0)) < 1e-9 and at == 40               # above dense everywhere: negative
    assert rm.gap_to_dense(DENSE, [[15, 0.1, 0.5]]) == (None, None)


def test_rate_changes_map_to_the_step_in_progress():
    step_end = [0.1, 0.2, 0.3, 0.5, 0.9, 1.3]                  # 6 steps; the 4th..6th slow
    assert rm.steps_done_at(step_end, 0.05) == 0
    assert rm.steps_done_at(step_end, 0.2) == 2                # a step ending exactly then counts as done
    assert rm.steps_done_at(step_end, 0.6) == 4
    assert rm.steps_done_at(step_end, 9.0) == 6                # after the job: len
    assert rm.change_steps(step_end, [(0.25, "50mbit"), (2.0, "1gbit")]) == [2, 6]
    assert rm.phases([2, 6], 6) == [(0, 2), (2, 6), (6, 6)]
    times = rm.phase_step_times(step_end, [(0, 2), (2, 6), (6, 6)])
    assert abs(times[0] - 0.1) < 1e-12 and abs(times[1] - 0.275) < 1e-12 and times[2] is None


def test_decisions_split_into_settle_windows_and_steady_parts():
    # 3 phases: [0, 100) start-up, [100, 250) after change 1, [250, 400) after change 2; window 40.
    ranges = rm.phases([100, 250], 400)
    got = rm.attribute_decisions([3, 10, 60, 101, 139, 140, 250, 255, 300, 399], ranges, 40)
    assert [p["settle"] for p in got] == [[3, 10], [101, 139], [250, 255]]
    assert [p["steady"] for p in got] == [[60], [140], [300, 399]]
    assert [p["settle_end"] for p in got] == [40, 140, 290]
    # A phase shorter than the window is all window; a change after the job ended owns nothing.
    got = rm.attribute_decisions([5, 12, 30], rm.phases([10, 50], 35), 40)
    assert [p["settle"] for p in got] == [[5], [12, 30], []] and [p["steady"] for p in got] == [[], [], []]


def test_a_dense_warm_up_lengthens_the_jobs_start_window():
    # A 100-step warm-up: the first answer after it (step 105) answers the start; window 40, so
    # every step before 140 is a settle step, in whichever phase it falls (a change at step 120:
    # phase 1's own window runs to 160). Without the warm-up, 105 is a steady decision.
    ranges = rm.phases([120, 300], 400)
    got = rm.attribute_decisions([3, 105, 139, 140, 121, 170, 301], ranges, 40, warmup_steps=100)
    assert [p["settle_end"] for p in got] == [120, 160, 340]
    assert [p["settle"] for p in got] == [[3, 105], [139, 140, 121], [301]]
    assert [p["steady"] for p in got] == [[], [170], []]
    got = rm.attribute_decisions([3, 105], rm.phases([300], 400), 40, warmup_steps=100)
    assert got[0]["settle_end"] == 140 and got[0]["settle"] == [3, 105] and got[0]["steady"] == []
    got = rm.attribute_decisions([3, 105], rm.phases([300], 400), 40)
    assert got[0]["settle"] == [3] and got[0]["steady"] == [105]


def test_the_warm_up_is_read_from_the_daemon_arguments():
    assert rm.warmup_steps_of(["--controller", "schedule,step", "--schedule-warmup-steps", "100"]) == 100
    assert rm.warmup_steps_of(["--controller=step,schedule", "--schedule-warmup-steps=6"]) == 6
    assert rm.warmup_steps_of(["--controller", "step", "--schedule-warmup-steps", "100"]) == 0, "no schedule"
    assert rm.warmup_steps_of(["--controller", "schedule"]) == 0
    assert rm.warmup_steps_of([]) == 0


def test_parse_decisions_reads_rank_0s_controller_lines_only():
    log = [
        "[info] decision epoch 1 from step 4 (controller bandwidth at step 2: density_cap 1 -> 0.004): density_cap=0.004",
        "[info] decision epoch 2 from step 9 (control: set): density=0.01",
        "[info] some other line",
        "[info] decision epoch 3 from step 60 (controller budget at step 57: threshold 0.01 -> 0.02 (x2.0)): threshold=0.02",
    ]
    d = rm.parse_decisions(log)
    assert [(x["epoch"], x["effective_step"], x["step"], x["controllers"]) for x in d] == \
        [(1, 4, 2, "bandwidth"), (3, 60, 57, "budget")]
    assert d[0]["knobs"] == "density_cap=0.004" and d[1]["change"].startswith("threshold 0.01 -> 0.02")


def test_parse_probes_reads_the_daemons_job_end_line():
    steps = list(range(16, 16 * 33, 16))                       # 32 steps kept of 40 sent
    log = [
        "[info] job summary: 400 steps (0 tensor steps failed) in 9.1 s, sent 90 MiB vs 1.7 GiB dense",
        "[info] link probes this job: 3 sent to rank 1, at steps 64,128,256",
        "[info] link probes this job: 40 sent to rank 1, at steps " + ",".join(map(str, steps)) + ",...",
    ]
    assert rm.parse_probes(log[:2]) == {"sent": 3, "to": 1, "steps": [64, 128, 256]}
    assert rm.parse_probes(log) == {"sent": 40, "to": 1, "steps": steps}  # the last job's line
    assert rm.parse_probes(log[:1]) == {"sent": 0, "to": None, "steps": []}
    assert rm.parse_probes(["[info] link probes this job: 2 sent to rank 0, at steps 8,x"])["sent"] == 0


def test_warmup_outcome_reads_the_step_controllers_cuts():
    before = {"effective_step": 0, "change": "step: warm-up cut before it starts: the trainer's dense step 59 ms"}
    during = {"effective_step": 4, "change": "step: warm-up cut: a ring step 52 ms measured, 2.4x a sparse step"}
    other = {"effective_step": 11, "change": "step: room: ... to the ring"}
    assert rm.warmup_outcome([before, other]) == "cut before it started"
    assert rm.warmup_outcome([during]) == "cut at step 4"
    assert rm.warmup_outcome([other]) == "ran" and rm.warmup_outcome([]) == "ran"
    assert rm.warmup_outcome(None) is None


def test_early_step_is_the_median_of_the_first_phases_steps():
    # Steps 0-2 (start-up) and from 41 on (after a drop) are not the first phase's.
    ends = [0.5, 1.0, 1.5] + [1.5 + 0.02 * i for i in range(1, 39)] + [2.26 + 0.9 * i for i in range(1, 20)]
    assert abs(rm.early_step_s({"step_end_s": ends}) - 0.02) < 1e-9
    ends = ends[:10] + [t + 0.3 for t in ends[10:]]                  # one stall (an evaluation): not the median
    assert abs(rm.early_step_s({"step_end_s": ends}) - 0.02) < 1e-9
    assert rm.early_step_s({"step_end_s": [0.1, 0.2, 0.3, 0.4]}) is None   # one step after the start-up
    assert rm.early_step_s({}) is None


def test_start_price_weighs_the_hint_as_the_controller_does():
    # The trainer's dense step 60 ms, 51 ms of it waiting: the rest 9 ms; at x2.5 a sparse step is
    # priced at 22.5 ms, so the dense step is 2.67 of them; the static job's steps took 20 ms: 3.0.
    hinted = {"dense_step_s": 0.060, "dense_wait_s": 0.051}
    static = {"step_end_s": [0.02 * i for i in range(1, 45)]}
    priced, measured = rm.start_price(hinted, static, 2.5)
    assert abs(priced - 0.060 / 0.0225) < 1e-9 and abs(measured - 3.0) < 1e-9
    assert abs(rm.start_price(hinted, static, 3.0)[0] - 0.060 / 0.027) < 1e-9
    assert rm.start_price({"dense_step_s": 0.06, "dense_wait_s": 0.06}, static, 2.5) is None  # no rest
    assert rm.start_price({"dense_step_s": None, "dense_wait_s": 0.0}, static, 2.5) is None
    assert rm.start_price(hinted, {"step_end_s": []}, 2.5) is None
    assert rm.start_price(None, static, 2.5) is None


def test_start_price_cli_counts_the_wrong_calls(tmp_path):
    # Two seeds at step_warmup_cut 2: seed 1's dense step is 3.0x a measured sparse step and priced
    # 2.67x at 2.5 (a cut, right), 2.22x at 3 (a cut, right); seed 2's is 2.5x measured and priced
    # 2.22x at 2.5 (right), 1.85x at 3 (kept: wrong).
    def seed(ds, wait, step):
        return {"profiles": {"down": {"settings": {
            "adaptive": {"dense_step_s": ds, "dense_wait_s": wait},
            "topk0.5": {"step_end_s": [step * i for i in range(1, 45)]}}}}}
    report = {"config": {"machine": {"cpus": 16, "cpu": "test"}},
              "models": {"large": {"seeds": {"1": seed(0.060, 0.051, 0.020), "2": seed(0.050, 0.041, 0.020)}}}}
    path = tmp_path / "r.json"
    path.write_text(__import__("json").dumps(report))
    tool = os.path.join(ROOT, "bench", "controllers", "start_price.py")
    out = subprocess.run([sys.executable, tool, str(path), "--factors", "3,2.5"], capture_output=True, text=True,
                         check=True).stdout
    rows = {line.split()[0]: line.split()[1:4] for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert rows["3"] == ["2", "0", "1"] and rows["2.5"] == ["2", "0", "0"], out
    bad = subprocess.run([sys.executable, tool, str(path), "--factors", "x"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--factors" in bad.stderr


def _statuses(checks):
    return {c["check"]: c["status"] for c in checks}


def test_checks_pass_and_fail_on_the_bounds():
    static = ["dense", "topk0.5", "topk2"]
    tta = {"dense": 10.0, "topk0.5": 8.0, "topk2": 9.0, "adaptive": 7.9}
    settled = rm.attribute_decisions([2, 101, 103, 105], rm.phases([100], 300), 40)
    c = _statuses(rm.adaptive_checks("down", tta, static, "adaptive", 0.97, 0.966, 4.9, settled))
    assert c == {"time_within_5pct_of_best_static": "PASS", "time_beats_every_static": "PASS",
                 "decisions_le_3_per_change": "PASS", "no_decisions_while_steady": "PASS",
                 "final_accuracy_within_0.5pp_of_dense": "PASS", "never_5pp_below_dense_curve": "PASS",
                 "no_decision_dips_below_static": "N/A"}
    # 8.4 s is within 5 % of 8.0 s (8.4 <= 8.4) but does not beat it; 4 decisions after a change;
    # one in a steady part; 0.6 pp below dense at the end; 5.1 pp below the curve once.
    tta["adaptive"] = 8.4
    busy = rm.attribute_decisions([101, 102, 103, 104, 200], rm.phases([100], 300), 40)
    c = _statuses(rm.adaptive_checks("down", tta, static, "adaptive", 0.97, 0.964, 5.1, busy))
    assert c == {"time_within_5pct_of_best_static": "PASS", "time_beats_every_static": "FAIL",
                 "decisions_le_3_per_change": "FAIL", "no_decisions_while_steady": "FAIL",
                 "final_accuracy_within_0.5pp_of_dense": "FAIL", "never_5pp_below_dense_curve": "FAIL",
                 "no_decision_dips_below_static": "N/A"}
    tta["adaptive"] = 8.41
    assert _statuses(rm.adaptive_checks("down", tta, static, "adaptive", 0.97, 0.97, 0.0, busy))[
        "time_within_5pct_of_best_static"] == "FAIL"


def test_steady_profile_has_no_beat_check_and_never_reaching_fails():
    static = ["dense", "topk0.5"]
    tta = {"dense": 10.0, "topk0.5": None, "adaptive": None}
    c = rm.adaptive_checks("steady", tta, static, "adaptive", 0.97, None, None, None)
    s = _statuses(c)
    assert "time_beats_every_static" not in s
    assert s["time_within_5pct_of_best_static"] == "FAIL"           # adaptive never reached it
    assert s["decisions_le_3_per_change"] == "N/A" and s["final_accuracy_within_0.5pp_of_dense"] == "N/A"
    assert rm.best_static(tta, static) == ("dense", 10.0)
    assert rm.best_static({"dense": None}, ["dense"]) == (None, None)


def test_an_incomplete_job_fails_broken_bounds_and_is_not_applicable_otherwise():
    static = ["dense", "topk2"]
    tta = {"dense": 10.0, "topk2": 9.0, "adaptive": None}
    quiet = rm.attribute_decisions([7], rm.phases([37], 37), 40)        # failed at step 37, 1 decision
    c = _statuses(rm.adaptive_checks("down", tta, static, "adaptive", 0.97, None, 0.9, quiet,
                                     phases_seen=False, completed=False))
    assert c["decisions_le_3_per_change"] == "N/A" and c["no_decisions_while_steady"] == "N/A"
    assert c["never_5pp_below_dense_curve"] == "N/A" and c["time_within_5pct_of_best_static"] == "FAIL"
    busy = rm.attribute_decisions([1, 2, 3, 4, 50], rm.phases([60], 60), 40)
    c = _statuses(rm.adaptive_checks("down", tta, static, "adaptive", 0.97, None, 6.0, busy,
                                     phases_seen=False, completed=False))
    assert c["decisions_le_3_per_change"] == "FAIL" and c["no_decisions_while_steady"] == "FAIL"
    assert c["never_5pp_below_dense_curve"] == "FAIL"


def test_median_time_counts_never_as_slowest_and_takes_the_upper_middle():
    assert rm.median_time([4.4, None, 5.3]) == 5.3             # seeds 1-3 of one setting
    assert rm.median_time([None, 6.0, None]) is None           # the median seed never got there
    assert rm.median_time([3.0, 1.0, 2.0, 4.0]) == 3.0          # even: the upper middle
    assert rm.median_time([1.0, None]) is None                  # reached in half the seeds only
    assert rm.median_time([]) is None
    assert rm.median_value([None, 0.2, 0.1]) == 0.2 and rm.median_value([None]) is None


def _run(tta, final, dense_final, gap, decisions, status="ok"):
    return {"time_to_target_s": tta, "final_accuracy": final, "dense_final": dense_final,
            "gap_below_dense_pp": gap, "status": status, "saw_profile": True,
            "attributed": rm.attribute_decisions(decisions, rm.phases([100], 300), 40)}


def test_paired_ratios_take_each_seed_against_its_own_baseline_in_seed_order():
    runs = {"10": {"a": {"time_to_target_s": 3.0}, "b": {"time_to_target_s": 2.0}},
            "2": {"a": {"time_to_target_s": None}, "b": {"time_to_target_s": 2.0}},
            "1": {"a": {"time_to_target_s": 1.0}, "b": {"time_to_target_s": 4.0}},
            "3": {"a": {"time_to_target_s": 1.0}}}
    assert rm.paired_ratios(runs, "a", "b") == [(0.25, None), (None, "a"), (None, "b"), (1.5, None)]


def test_each_seed_runs_the_settings_rotated_so_that_none_always_follows_another():
    settings = ["topk0.5", "adaptive", "dense"]
    orders = [rm.job_order(settings, k) for k in range(6)]
    assert orders[0] == settings and orders[1] == ["adaptive", "dense", "topk0.5"]
    assert orders[3] == settings                                   # the rotation repeats
    for s in settings:                                             # first, second, third equally often
        assert sorted(o.index(s) for o in orders) == [0, 0, 1, 1, 2, 2]
    assert rm.job_order(["adaptive"], 5) == ["adaptive"]
    assert rm.job_order([], 2) == []


def test_a_jobs_pace_is_its_median_step_after_the_first_ones_and_seeds_pair_by_value():
    # Steps of 1 s for 20 steps (the start), then 10, 30, 20 and 400 ms (an evaluation).
    ends = [float(i + 1) for i in range(21)]
    for d in (0.010, 0.030, 0.020, 0.400):
        ends.append(ends[-1] + d)
    job = {"step_end_s": ends, "compute_seconds": {"mean": 0.01, "median": 0.008}}
    assert abs(rm.median_step_s(job) - 0.025) < 1e-9          # the median of 10, 30, 20, 400 ms
    assert abs(rm.median_step_s(job, skip=21) - 0.030) < 1e-9  # of 30, 20, 400 ms
    assert rm.median_step_s({"step_end_s": ends[:21]}) is None
    assert rm.compute_median_s(job) == 0.008
    assert rm.compute_median_s({"compute_seconds": None}) is None
    slower = dict(job, compute_seconds={"median": 0.010})
    runs = {"2": {"adaptive": slower, "topk0.5": job}, "1": {"adaptive": job, "topk0.5": slower},
            "3": {"adaptive": job}}                           # seed 3: no top-k job
    got = rm.paired_values(runs, "adaptive", "topk0.5", rm.compute_median_s)
    assert [round(x, 9) for x in got] == [0.8, 1.25]           # seeds 1, 2 in order
    # The parts of a trainer's compute pair the same way; a part not reported (or 0) is none.
    parts = dict(job, compute_parts={"forward": 0.002, "backward": 0.004, "cpu_wait_per_step": 0.0})
    assert rm.compute_part("backward")(parts) == 0.004
    assert rm.compute_part("cpu_wait_per_step")(parts) is None and rm.compute_part("forward")(job) is None
    runs = {"1": {"adaptive": dict(parts, compute_parts={"forward": 0.003}), "topk0.5": parts}}
    assert rm.paired_values(runs, "adaptive", "topk0.5", rm.compute_part("forward")) == [1.5]


def test_the_paired_interval_is_students_t_on_the_logs_of_the_ratios():
    # Two seeds, ratios 2 and 8: the logs are ln 2 and 3 ln 2, mean 2 ln 2 (geometric mean 4),
    # standard deviation sqrt(2) ln 2, so the half width is t(0.95, 1 df) = 6.314 times ln 2.
    g, lo, hi = rm.paired_interval([2.0, 8.0])
    assert math.isclose(g, 4.0) and math.isclose(lo, 4.0 * 2 ** -6.314) and math.isclose(hi, 4.0 * 2 ** 6.314)
    # Three seeds whose logs are -a, 0, a: mean 0, sd a, half width t(0.95, 2 df) a / sqrt(3).
    a = 0.1
    g, lo, hi = rm.paired_interval([math.exp(-a), 1.0, math.exp(a)])
    assert math.isclose(g, 1.0) and math.isclose(hi, math.exp(2.920 * a / math.sqrt(3)))
    assert math.isclose(lo * hi, 1.0)
    assert rm.paired_interval([1.3]) is None and rm.paired_interval([]) is None


def _timed(times):
    """runs for seeds 1..n: {seed: {setting: {"time_to_target_s": t}}} from {setting: [t, ...]}."""
    n = len(next(iter(times.values())))
    return {i + 1: {s: {"time_to_target_s": ts[i]} for s, ts in times.items()} for i in range(n)}


def test_the_paired_checks_pass_fail_or_say_the_seeds_cannot_tell():
    def statuses(times, profile="down"):
        best = rm.best_static({s: rm.median_time(ts) for s, ts in times.items() if s != "adaptive"},
                              [s for s in times if s != "adaptive"])[0]
        return {c["check"]: c["status"] for c in rm.paired_checks(profile, _timed(times),
                                                                 [s for s in times if s != "adaptive"], "adaptive", best)}
    # Every seed exactly 10 % slower than top-k: no spread, so the interval is 1.10 at both ends.
    slow = {"topk": [3.0, 5.0, 4.0], "dense": [6.0, 6.0, 6.0], "adaptive": [3.3, 5.5, 4.4]}
    assert statuses(slow) == {"time_within_5pct_paired": "FAIL", "time_beats_every_static_paired": "FAIL"}
    # 2 % slower on every seed: inside 5 %, but not below top-k's time.
    close = {"topk": [3.0, 5.0, 4.0], "dense": [6.0, 6.0, 6.0], "adaptive": [3.06, 5.1, 4.08]}
    assert statuses(close) == {"time_within_5pct_paired": "PASS", "time_beats_every_static_paired": "FAIL"}
    # 20 % faster than both on every seed, give or take 1 %: beats both.
    fast = {"topk": [3.0, 5.0, 4.0], "dense": [6.0, 7.0, 5.0], "adaptive": [2.4, 4.0, 3.2]}
    fast["adaptive"][1] = 4.04
    assert statuses(fast) == {"time_within_5pct_paired": "PASS", "time_beats_every_static_paired": "PASS"}
    # 0.8x, 1.0x, 1.25x of top-k: the seeds cannot tell either way; steady has no beat check.
    mixed = {"topk": [3.0, 5.0, 4.0], "adaptive": [2.4, 5.0, 5.0]}
    assert statuses(mixed, "steady") == {"time_within_5pct_paired": "N/A"}
    # A seed where the adaptive job never got there is left out and said so.
    never = {"topk": [3.0, 5.0, 4.0, 4.0], "adaptive": [3.3, 5.5, 4.4, None]}
    c = rm.paired_checks("steady", _timed(never), ["topk"], "adaptive", "topk")
    assert c[0]["status"] == "FAIL" and "over 3 seeds; 1 seed(s) left out" in c[0]["detail"]


def test_seeds_checks_take_medians_of_times_and_gaps_and_the_worst_seeds_decisions():
    static = ["topk0.1", "dense"]
    runs = {  # topk0.1 reaches the target at 4.4 s / never / 5.3 s; adaptive 5.0 / 4.6 / 9.0
        1: {"topk0.1": _run(4.4, 0.971, 0.971, 36.0, []), "dense": _run(6.0, 0.971, 0.971, 0.0, []),
            "adaptive": _run(5.0, 0.971, 0.971, 4.0, [2, 101])},
        2: {"topk0.1": _run(None, 0.964, 0.971, 42.0, []), "dense": _run(6.1, 0.971, 0.971, 0.0, []),
            "adaptive": _run(4.6, 0.968, 0.972, 4.5, [2, 101, 102, 103])},
        3: {"topk0.1": _run(5.3, 0.969, 0.970, 47.0, []), "dense": _run(6.2, 0.970, 0.970, 0.0, []),
            "adaptive": _run(9.0, 0.962, 0.970, 6.0, [2])},
    }
    c = rm.seeds_checks("down", runs, static, "adaptive")
    s = _statuses(c)
    # Medians: topk0.1 5.3 s, dense 6.1 s, adaptive 5.0 s (beats both); shortfalls 0 / 0.4 / 0.8 pp
    # -> 0.4 pp; curve gaps 4.0 / 4.5 / 6.0 -> 4.5 pp. Seed 2 answered the change with 3 decisions;
    # no seed decided while steady.
    # Paired, the seeds cannot tell (two pairs against topk0.1, 1.14 and 1.70; against dense 0.83,
    # 0.75 and 1.45): both intervals straddle their bounds.
    assert s == {"time_within_5pct_of_best_static": "PASS", "time_beats_every_static": "PASS",
                 "time_within_5pct_paired": "N/A", "time_beats_every_static_paired": "N/A",
                 "decisions_le_3_per_change": "PASS", "no_decisions_while_steady": "PASS",
                 "final_accuracy_within_0.5pp_of_dense": "PASS", "never_5pp_below_dense_curve": "PASS",
                 "no_decision_dips_below_static": "N/A"}
    assert "4.50 pp" in next(x["detail"] for x in c if x["check"] == "never_5pp_below_dense_curve")
    # Paired per seed against the best static (topk0.1): 5.0/4.4, topk0.1 never there, 9.0/5.3.
    assert "per seed adaptive / topk0.1: 1.14, topk0.1 never, 1.70" in next(
        x["detail"] for x in c if x["check"] == "time_within_5pct_of_best_static")
    # One seed's 4th decision after the change, another's decision while steady: the worst seed counts.
    runs[3]["adaptive"] = _run(9.0, 0.962, 0.970, 6.0, [2, 101, 102, 103, 104])
    runs[1]["adaptive"] = _run(5.0, 0.971, 0.971, 4.0, [2, 200])
    s = _statuses(rm.seeds_checks("down", runs, static, "adaptive"))
    assert s["decisions_le_3_per_change"] == "FAIL" and s["no_decisions_while_steady"] == "FAIL"
    # The median seed 0.6 pp short of its dense run fails the final-accuracy bound.
    runs[1]["adaptive"]["final_accuracy"] = 0.965
    runs[2]["adaptive"]["final_accuracy"] = 0.966
    assert _statuses(rm.seeds_checks("down", runs, static, "adaptive"))[
        "final_accuracy_within_0.5pp_of_dense"] == "FAIL"


def test_a_decisions_dip_is_the_fall_after_it_against_the_static_runs_at_the_same_steps():
    # A decision from step 25: the last evaluation at or before it is step 20 (adaptive 0.90,
    # static 0.88); the window (25, 75] holds steps 30-70: the adaptive curve's lowest 0.85 (a
    # 5 pp fall), the static's 0.87 (1 pp). From step 60: before at 60 (0.95 / 0.93), after 70
    # and 80 (0.96 / 0.92): the adaptive rises (0), the static falls 1 pp. Step 0 has no
    # evaluation before it and step 80 none after it: left out. Each step once.
    steps = [10, 20, 30, 40, 50, 60, 70, 80]
    ad = [0.80, 0.90, 0.85, 0.88, 0.92, 0.95, 0.96, 0.97]
    st = [0.81, 0.88, 0.87, 0.89, 0.90, 0.93, 0.92, 0.94]
    curve = [[n, 0.1 * n, a] for n, a in zip(steps, ad)]
    static = [[n, 0.1 * n, a] for n, a in zip(steps, st)]
    dips = rm.decision_dips(curve, static, [60, 25, 0, 80, 25], window=50)
    assert [d["step"] for d in dips] == [25, 60]
    assert abs(dips[0]["drop_pp"] - 5.0) < 1e-9 and abs(dips[0]["static_drop_pp"] - 1.0) < 1e-9
    assert dips[1]["drop_pp"] == 0.0 and abs(dips[1]["static_drop_pp"] - 1.0) < 1e-9  # the lowest of 0.92, 0.94
    # The mean standing after each: steps 30-70, static - adaptive = +2, +1, -2, -2, -4 pp -> -1.0;
    # steps 70, 80: -4, -3 -> -3.5 (above the static run both times).
    assert abs(dips[0]["below_static_pp"] - (-1.0)) < 1e-9 and abs(dips[1]["below_static_pp"] - (-3.5)) < 1e-9
    # Only steps both curves evaluated count.
    assert rm.decision_dips(curve, static[:1], [25]) == []


def test_the_dip_check_allows_the_static_runs_fall_plus_the_evaluation_noise():
    static = ["dense", "topk0.5"]
    tta = {"dense": 10.0, "topk0.5": 8.0, "adaptive": 7.9}
    quiet = rm.attribute_decisions([2], rm.phases([100], 300), 40)

    def dip_check(dips):
        c = rm.adaptive_checks("down", tta, static, "adaptive", 0.97, 0.97, 1.0, quiet, dips=dips)
        return next(x for x in c if x["check"] == "no_decision_dips_below_static")

    # 5 pp against the static run's 1 pp: fails; 1.9 pp against 1 pp: within the 1 pp of noise.
    assert dip_check([{"step": 25, "drop_pp": 5.0, "static_drop_pp": 1.0}])["status"] == "FAIL"
    ok = dip_check([{"step": 25, "drop_pp": 1.9, "static_drop_pp": 1.0}, {"step": 60, "drop_pp": 0.0,
                                                                        "static_drop_pp": 2.0}])
    assert ok["status"] == "PASS" and "from step 25" in ok["detail"], ok
    assert "on average" not in ok["detail"]  # a JSON without the mean says nothing of it
    told = dip_check([{"step": 25, "drop_pp": 5.0, "static_drop_pp": 1.0, "below_static_pp": -2.5}])
    assert told["status"] == "FAIL" and "stood 2.50 pp above the static run on average" in told["detail"], told
    assert dip_check([])["status"] == "N/A" and dip_check(None)["status"] == "N/A"
    # Over seeds every seed's decisions count, each against its own seed's static run.
    runs = {1: {"topk0.5": _run(8.0, 0.97, 0.97, 3.0, []), "adaptive": _run(7.9, 0.97, 0.97, 3.0, [2])},
            2: {"topk0.5": _run(8.0, 0.97, 0.97, 3.0, []), "adaptive": _run(7.9, 0.97, 0.97, 3.0, [2])}}
    runs[1]["adaptive"]["decision_dips"] = [{"step": 25, "drop_pp": 0.5, "static_drop_pp": 0.0}]
    runs[2]["adaptive"]["decision_dips"] = []
    assert _statuses(rm.seeds_checks("down", runs, ["topk0.5"], "adaptive"))["no_decision_dips_below_static"] == "PASS"
    runs[2]["adaptive"]["decision_dips"] = [{"step": 30, "drop_pp": 4.0, "static_drop_pp": 0.5}]
    assert _statuses(rm.seeds_checks("down", runs, ["topk0.5"], "adaptive"))["no_decision_dips_below_static"] == "FAIL"


def test_the_static_run_of_the_same_plan_is_top_k_at_the_controllers_density():
    d = {"0.1": 0.001, "0.5": 0.005, "2": 0.02}
    args = ["--compression", "on", "--controller", "schedule,step", "--schedule-warmup-steps", "6",
            "--selector", "topk", "--density", "0.005"]
    assert rm.static_of(args, d) == "topk0.5"
    assert rm.static_of(["--density=0.02"], d) == "topk2"                       # top-k is the default
    assert rm.static_of(["--selector", "threshold", "--density", "0.005"], d) is None
    assert rm.static_of(["--density", "0.003"], d) is None                      # no such static setting
    assert rm.static_of(["--density", "x"], d) is None and rm.static_of([], d) is None


def _report(seeds, models=("small",)):
    """A report as real.py writes it: one seed 1 holds the model's part itself, else "seeds"."""
    def part(seed):
        return {"dense_curves_agree": seed != 3, "profiles": {"down": {"settings": {"marker": seed}}}}
    out = {"config": {"wall_s": 10.0 * len(seeds)}, "models": {}}
    for m in models:
        out["models"][m] = part(1) if list(seeds) == [1] else {
            "dense_curves_agree": all(s != 3 for s in seeds), "seeds": {str(s): part(s) for s in seeds}}
    return out


def test_reports_of_one_run_in_several_calls_join_by_seed():
    import real  # noqa: E402  (bench/controllers/real.py: stdlib only at import)
    joined = real.join_reports([_report([1]), _report([2, 3])], ["a.json", "b.json"])
    seeds = joined["models"]["small"]["seeds"]
    assert sorted(seeds) == ["1", "2", "3"]
    assert [seeds[s]["profiles"]["down"]["settings"]["marker"] for s in ("1", "2", "3")] == [1, 2, 3]
    assert joined["models"]["small"]["dense_curves_agree"] is False  # seed 3's curves differ
    assert joined["config"]["wall_s"] == 30.0
    assert real.join_reports([_report([1]), _report([2])], ["a", "b"])["models"]["small"]["dense_curves_agree"]


def test_reports_that_do_not_fit_together_are_refused():
    import pytest
    import real  # noqa: E402
    with pytest.raises(SystemExit, match="seed 2 of small is in two reports"):
        real.join_reports([_report([2, 4]), _report([2])], ["a.json", "b.json"])
    with pytest.raises(SystemExit, match="has models"):
        real.join_reports([_report([1]), _report([2], models=("small", "large"))], ["a.json", "b.json"])


def test_a_processs_cpu_seconds_are_its_user_and_system_ticks():
    # Fields 14 and 15 of /proc/PID/stat (utime 150, stime 50 ticks) at 100 ticks a second; the
    # command name may hold spaces and parentheses.
    line = "4242 (a) b) S 1 4242 4242 0 -1 4194560 500 0 0 0 150 50 0 0 20 0 3 0 100 0 0"
    assert cpu_seconds_of_stat(line, 100) == 2.0
    assert cpu_seconds_of_stat("4242 (x) S 1", 100) is None
    # This process, against what Python itself counts (the kernel's ticks: 10 ms here).
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert abs(cpu_seconds(os.getpid()) - time.process_time()) < 0.05
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert cpu_seconds(gone.pid) is None


def test_the_first_iterations_hint_is_the_hooks_weighing_of_those_iterations():
    """start_price.py --dense-iterations 2: the hint of a hook that ran only the first two of a
    job's dense iterations, by hand: the quickest period of the two (60 ms) and that period less
    the least rest of the two (min(80 - 50, 60 - 48) = 12 ms), not the third's 7 ms."""
    import start_price
    job = {"dense_step_s": 0.065, "dense_wait_s": 0.058,
           "dense_timings_s": [[0.080, 0.050], [0.060, 0.048], [0.065, 0.058]]}
    h = start_price.first_iterations_hint(job, 2)
    assert abs(h["dense_step_s"] - 0.060) < 1e-12 and abs(h["dense_wait_s"] - 0.048) < 1e-12
    assert job["dense_step_s"] == 0.065  # the report's entry is left as it was
    assert start_price.first_iterations_hint({"dense_step_s": 0.1}, 2) == {"dense_step_s": 0.1}
