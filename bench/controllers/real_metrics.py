"""The arithmetic of `scripts/bench controllers --real` (bench/controllers/real.py): time to
accuracy, the gap to the dense curve, mapping rate changes (seconds) to training steps, decisions
attributed to rate changes or to steady rates, and issue 14's checks. Pure functions of plain
lists and dicts: no processes, no clock, no files; standard library only, so the unit test
(tests/integration/python/test_controllers_real_metrics.py) runs in a fraction of a second.

Conventions (docs/controllers.md, "Real jobs"):
  curve        [[steps done, training seconds (evaluation excluded), test accuracy], ...]
  step_end_s   rank 0's wall time (seconds since its first training step) at the end of each
               step, index i = step i (0-based); evaluation pauses included (it is wall time)
  change_s     [(seconds since the first training step, rate), ...] when each rate change took
               effect on the link (after `tc qdisc change` returned)
  decision     {"step": the step whose observation triggered it, ...} (rank 0's log)
"""

import bisect
import math
import re

CHANGING_PROFILES = ("down", "up", "oscillating")

# Issue 14's bounds.
TTA_SLACK = 0.05          # adaptive within 5 % of the best static setting in hindsight
MAX_DECISIONS_PER_CHANGE = 3
FINAL_ACCURACY_PP = 0.5   # final accuracy at most 0.5 pp below dense
CURVE_GAP_PP = 5.0        # never more than 5 pp below the dense curve at the same step
# "No decision may cause a dip larger than the same job's static run shows at that step": the
# accuracy's fall over the evaluations in the DIP_WINDOW_STEPS steps after a decision takes
# effect, against the static run's (the same plan, same seed) over the same steps; DIP_NOISE_PP
# is the evaluation noise allowed between two runs (one test image of the digits set is 0.28 pp).
DIP_WINDOW_STEPS = 50
DIP_NOISE_PP = 1.0
# The paired checks' interval: two-sided 90 % (Student's t on the log of per-seed ratios).
PAIRED_LEVEL = 0.90
# t's 0.95 quantile by degrees of freedom (1..30; beyond, the normal's 1.645).
_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761,
        1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701,
        1.699, 1.697)


def time_to_accuracy(curve, target):
    """(training seconds, steps) at the first evaluation at or above target; (None, None) if
    none is. The 1e-9 slack makes a run that ends exactly at the target count."""
    for steps, secs, acc in curve:
        if acc >= target - 1e-9:
            return secs, steps
    return None, None


def gap_to_dense(dense_curve, curve):
    """The largest (dense accuracy - this accuracy) over the evaluation steps both curves have,
    in percentage points, and the step where it is; (None, None) without a common step.
    Negative when the curve is above dense everywhere."""
    dense = {steps: acc for steps, _, acc in dense_curve}
    worst, at = None, None
    for steps, _, acc in curve:
        if steps in dense:
            gap = 100.0 * (dense[steps] - acc)
            if worst is None or gap > worst + 1e-12:
                worst, at = gap, steps
    return worst, at


def decision_dips(curve, static_curve, effective_steps, window=DIP_WINDOW_STEPS):
    """Per decision taking effect at step S (each S once, in order): {"step": S, "drop_pp": the
    curve's fall, "static_drop_pp": the static curve's, "below_static_pp": the mean of (static -
    this) over the evaluations in (S, S + window], in pp (negative: above the static run)}, a fall
    being the accuracy at the last evaluation at or before S less the lowest over the evaluations
    in (S, S + window], in pp, 0 when it does not fall. The static curve is read at the same
    evaluation steps. The mean shows what a single evaluation's fall does not: early in training
    one evaluation swings by several pp in every run, dense too. A decision without such
    evaluations on both curves (one from step 0, one at the job's end) is left out."""
    static = {steps: acc for steps, _, acc in static_curve}
    own = {steps: acc for steps, _, acc in curve}
    common = sorted(set(static) & set(own))
    out = []
    for s in sorted(set(effective_steps)):
        before = [x for x in common if x <= s]
        after = [x for x in common if s < x <= s + window]
        if not before or not after:
            continue
        b = before[-1]
        out.append({"step": s,
                    "drop_pp": max(0.0, 100.0 * (own[b] - min(own[x] for x in after))),
                    "static_drop_pp": max(0.0, 100.0 * (static[b] - min(static[x] for x in after))),
                    "below_static_pp": 100.0 * sum(static[x] - own[x] for x in after) / len(after)})
    return out


def steps_done_at(step_end_s, t):
    """Steps finished by time t: the 0-based index of the step in progress at t (len when the job
    had ended)."""
    return bisect.bisect_right(step_end_s, t)


def change_steps(step_end_s, change_s):
    """Each rate change's step: the step in progress when the link changed."""
    return [steps_done_at(step_end_s, t) for t, _ in change_s]


def phases(change_at_steps, steps_total):
    """Phase i = steps [start_i, end_i): phase 0 from step 0 (the job's start), phase i >= 1
    from change i. A change after the job ended gives an empty phase (start = end = steps_total)."""
    starts = [0] + [min(s, steps_total) for s in change_at_steps]
    ends = starts[1:] + [steps_total]
    return [(a, max(a, b)) for a, b in zip(starts, ends)]


def attribute_decisions(decision_steps, phase_ranges, settle_steps, warmup_steps=0):
    """Splits decisions by phase and, inside a phase, into its settle window (the first
    settle_steps steps of the phase: the reaction to the change that started it, or to the job's
    start in phase 0) and its steady part (the rest). A decision at step s belongs to the last
    phase starting at or before s. warmup_steps: a dense warm-up the job was configured with (the
    schedule's); the job's start lasts until it ends, so every step before warmup_steps +
    settle_steps is in a settle window too (the first answer after a warm-up answers the start).
    Returns one dict per phase."""
    start_end = warmup_steps + settle_steps if warmup_steps > 0 else 0
    out = [{"start": a, "end": b, "settle_end": min(b, max(a + settle_steps, start_end)), "settle": [], "steady": []}
           for a, b in phase_ranges]
    starts = [a for a, _ in phase_ranges]
    for s in decision_steps:
        i = bisect.bisect_right(starts, s) - 1
        while i > 0 and phase_ranges[i][0] == phase_ranges[i][1]:  # empty phases own nothing
            i -= 1
        if i < 0:
            i = 0
        p = out[i]
        (p["settle"] if s < p["settle_end"] else p["steady"]).append(s)
    return out


def phase_step_times(step_end_s, phase_ranges):
    """Mean wall seconds per step in each phase (None for an empty phase)."""
    out = []
    for a, b in phase_ranges:
        if b <= a or b > len(step_end_s):
            out.append(None)
            continue
        t_start = step_end_s[a - 1] if a > 0 else 0.0
        out.append((step_end_s[b - 1] - t_start) / (b - a))
    return out


_DECISION = re.compile(r"decision epoch (\d+) from step (\d+) \((.*)\): (.*)$")
_AT_STEP = re.compile(r"^controller (\S+) (?:at|before) step (\d+): ?(.*)$")  # before: on the trainer's start hint


def parse_decisions(log_lines):
    """Rank 0's 'decision epoch E from step S (controller NAMES at|before step s: what): knob=value'
    lines (DecisionBoard, INFO). Only the controllers' decisions (not 'control: ...' ones from
    sparsecarctl). Returns [{"epoch", "effective_step", "step", "controllers", "change", "knobs"}]."""
    out = []
    for line in log_lines:
        m = _DECISION.search(line)
        if not m:
            continue
        r = _AT_STEP.match(m.group(3))
        if not r:
            continue
        out.append({"epoch": int(m.group(1)), "effective_step": int(m.group(2)), "controllers": r.group(1),
                    "step": int(r.group(2)), "change": r.group(3)[:200], "knobs": m.group(4).strip()[:200]})
    return out


_PROBES = re.compile(r"link probes this job: (\d+) sent to rank (\d+), at steps ([\d,]+)(,\.\.\.)?\s*$")


def parse_probes(log_lines):
    """A daemon's 'link probes this job: N sent to rank R, at steps a,b,...' line (INFO, written as
    its job ends: daemon/pipeline/link_probe.h, LinkProbe::job_summary; at most the first 32 steps,
    then ',...'). Returns {"sent": N, "to": R, "steps": [a, b, ...]} of the last such line, or
    {"sent": 0, "to": None, "steps": []} where none (the daemon sent no probe)."""
    out = {"sent": 0, "to": None, "steps": []}
    for line in log_lines:
        m = _PROBES.search(line)
        if m:
            out = {"sent": int(m.group(1)), "to": int(m.group(2)), "steps": [int(x) for x in m.group(3).split(",")]}
    return out


def warmup_outcome(decisions):
    """What became of the schedule's dense warm-up, from rank 0's decisions (parse_decisions): "cut
    before it started" (the step controller's cut on the trainer's start hint), "cut at step S" (its
    cut while the warm-up ran: the decision's effective step), "ran" (no cut), or None where the
    decisions are unknown."""
    if decisions is None:
        return None
    for d in decisions:
        if "warm-up cut before it starts" in d["change"]:
            return "cut before it started"
        if "warm-up cut:" in d["change"]:
            return f"cut at step {d['effective_step']}"
    return "ran"


def early_step_s(entry, first=3, last=40):
    """A job's median step time over steps first .. last-1 (step_end_s): what its plan cost in the
    job's first phase, before a rate change; None with fewer than two such steps."""
    t = (entry.get("step_end_s") or [])[first:last + 1]
    return _median_step(t) if len(t) > 2 else None


def start_price(hinted, static, factor):
    """The step controller's pre-start weighing (policies' before_start) against what came after,
    for one seed: (priced, measured) where priced = the trainer's dense step / (factor x its rest,
    the step less its exchange wait), the ratio the warm-up cut compares with step_warmup_cut, and
    measured = the same dense step / the static sparse job's early step (early_step_s: its plan on
    the same link, same seed). `hinted`: the job whose trainers' dense steps were the hint (the
    adaptive one: dense_step_s, dense_wait_s); None where either is not known."""
    ds, wait = (hinted or {}).get("dense_step_s"), (hinted or {}).get("dense_wait_s")
    sparse = early_step_s(static) if static else None
    if not isinstance(ds, (int, float)) or not isinstance(wait, (int, float)) or not sparse or not ds > wait >= 0:
        return None
    return ds / (factor * (ds - wait)), ds / sparse


def best_static(tta, static_settings):
    """(setting, seconds) of the static setting that reached the target first; (None, None) if
    none did. tta: {setting: seconds or None}."""
    reached = [(t, s) for s, t in tta.items() if s in static_settings and t is not None]
    if not reached:
        return None, None
    t, s = min(reached)
    return s, t


def check(name, ok, detail):
    """One check: ok is True, False, or None (not applicable / not measurable)."""
    return {"check": name, "status": "N/A" if ok is None else ("PASS" if ok else "FAIL"), "detail": detail}


def adaptive_checks(profile, tta, static_settings, adaptive, dense_final, adaptive_final, curve_gap_pp,
                    phase_decisions, phases_seen=True, completed=True, dips=None):
    """Issue 14's checks for the adaptive setting on one (model, profile).
    tta: {setting: seconds or None}; phase_decisions: attribute_decisions' output for the adaptive
    job (None if it has none: no log); phases_seen: the job ran steps in the profile's phases;
    completed: it ran all its steps; dips: decision_dips' output against the static run of the
    same plan (None: no such run or no decision log). A bound already broken fails; one that
    holds on what an incomplete job showed is N/A, not PASS."""
    partial = "" if completed and phases_seen else \
        (" (the job did not complete)" if not completed else " (the job did not see every phase)")
    out = []
    best, t_best = best_static(tta, static_settings)
    t = tta.get(adaptive)
    fmt = lambda x: "never" if x is None else f"{x:.2f} s"  # noqa: E731
    if t_best is None:
        out.append(check("time_within_5pct_of_best_static", None, "no static setting reached the target"))
    else:
        ok = t is not None and t <= (1.0 + TTA_SLACK) * t_best
        out.append(check("time_within_5pct_of_best_static", ok,
                         f"adaptive {fmt(t)} vs best static {best} {fmt(t_best)} (bound {fmt((1 + TTA_SLACK) * t_best)})"))
    if profile in CHANGING_PROFILES:
        if t_best is None:
            out.append(check("time_beats_every_static", None, "no static setting reached the target"))
        else:
            slower = [s for s in static_settings if s in tta and tta[s] is not None and (t is None or tta[s] <= t)]
            out.append(check("time_beats_every_static", t is not None and not slower,
                             f"adaptive {fmt(t)}; static at or below it: {', '.join(slower) or 'none'}"))
    if phase_decisions is None:
        out.append(check("decisions_le_3_per_change", None, "no decision log"))
        out.append(check("no_decisions_while_steady", None, "no decision log"))
    else:
        per = [len(p["settle"]) for p in phase_decisions]
        steady = sum(len(p["steady"]) for p in phase_decisions)
        worst = max(per) if per else 0
        out.append(check("decisions_le_3_per_change", _bound(worst <= MAX_DECISIONS_PER_CHANGE, partial),
                         "settle-window decisions per phase (start, change 1, ...): " + str(per) + partial))
        out.append(check("no_decisions_while_steady", _bound(steady == 0, partial),
                         f"{steady} decisions outside the settle windows, at steps "
                         f"{[s for p in phase_decisions for s in p['steady']][:12]}" + partial))
    if dense_final is None or adaptive_final is None:
        out.append(check("final_accuracy_within_0.5pp_of_dense", None, "a final accuracy is missing (timeout?)"))
    else:
        d = 100.0 * (dense_final - adaptive_final)
        out.append(check("final_accuracy_within_0.5pp_of_dense", d <= FINAL_ACCURACY_PP + 1e-9,
                         f"adaptive {100 * adaptive_final:.2f} % vs dense {100 * dense_final:.2f} % ({-d:+.2f} pp)"))
    if curve_gap_pp is None:
        out.append(check("never_5pp_below_dense_curve", None, "no common evaluation step"))
    else:
        out.append(check("never_5pp_below_dense_curve",
                         _bound(curve_gap_pp <= CURVE_GAP_PP + 1e-9, "" if completed else partial),
                         f"largest gap below the dense curve {curve_gap_pp:.2f} pp" + ("" if completed else partial)))
    if dips is None:
        out.append(check("no_decision_dips_below_static", None, "no static run of the same plan, or no decision log"))
    elif not dips:
        out.append(check("no_decision_dips_below_static", None, "no decision with evaluations before and after it"))
    else:
        worst = max(dips, key=lambda d: d["drop_pp"] - d["static_drop_pp"])
        out.append(check("no_decision_dips_below_static",
                         worst["drop_pp"] <= worst["static_drop_pp"] + DIP_NOISE_PP + 1e-9,
                         f"{len(dips)} decisions; the worst: from step {worst['step']} the accuracy fell "
                         f"{worst['drop_pp']:.2f} pp in {DIP_WINDOW_STEPS} steps, the static run's "
                         f"{worst['static_drop_pp']:.2f} pp (allowed: + {DIP_NOISE_PP:g} pp)" + _mean_gap(worst)))
    return out


def _mean_gap(dip):
    """The worst decision's mean standing against the static run after it (older JSONs lack it)."""
    gap = dip.get("below_static_pp")
    if gap is None:
        return ""
    return f"; over those {DIP_WINDOW_STEPS} steps it stood {abs(gap):.2f} pp " \
           f"{'below' if gap > 0 else 'above'} the static run on average"


def median_time(times):
    """The median of per-seed times to target, a seed that never reached it counting as slower than
    any that did; None when the median seed never reached it. With an even count the upper of the
    two middle values: a setting must reach the target in at least half the seeds."""
    if not times:
        return None
    ranked = sorted(times, key=lambda t: math.inf if t is None else t)
    return ranked[len(ranked) // 2]


def median_value(values):
    """The median of the known values (upper middle with an even count); None when none is known."""
    known = sorted(v for v in values if v is not None)
    return known[len(known) // 2] if known else None


def seeds_checks(profile, runs, static_settings, adaptive):
    """Issue 14's checks over several trainer seeds. runs: {seed: {setting: entry}}, each entry
    analysed against its own seed's dense run (time_to_target_s, final_accuracy, dense_final,
    gap_below_dense_pp, attributed, saw_profile, status). Times to target and the final and curve
    gaps are the medians over the seeds (one seed's curve near the plateau crosses the target a
    hundred steps early or late); the decision bounds hold for the worst seed: every seed's
    decisions are the controller's. After the median time checks, the same two on the seeds
    paired (paired_checks): where a median says FAIL, they say whether the seeds can tell."""
    settings = {s for r in runs.values() for s in r}
    tta = {s: median_time([r[s].get("time_to_target_s") for r in runs.values() if s in r]) for s in settings}
    ad = [r[adaptive] for r in runs.values() if adaptive in r]
    # The final-accuracy check compares the median seed's shortfall: pass dense 0 and -shortfall.
    shortfalls = [e["dense_final"] - e["final_accuracy"] for e in ad
                  if e.get("final_accuracy") is not None and e.get("dense_final") is not None]
    short = median_value(shortfalls)
    gap = median_value([e.get("gap_below_dense_pp") for e in ad])
    logs = [e["attributed"] for e in ad if e.get("attributed") is not None]
    # Every seed's decisions are the controller's: all of them, each against its own seed's static run.
    dip_runs = [e["decision_dips"] for e in ad if e.get("decision_dips") is not None]
    dips = [d for run in dip_runs for d in run] if dip_runs else None
    worst = None
    if logs:
        worst = [{"settle": max((lg[i]["settle"] for lg in logs), key=len),
                  "steady": max((lg[i]["steady"] for lg in logs), key=len)} for i in range(min(map(len, logs)))]
    out = adaptive_checks(profile, tta, static_settings, adaptive, None if short is None else 0.0,
                          None if short is None else -short, gap, worst,
                          all(e.get("saw_profile", True) for e in ad), all(e.get("status") == "ok" for e in ad), dips)
    best, _ = best_static(tta, static_settings)
    for c in out:
        if c["check"].startswith("time_within") and best is not None:
            c["detail"] += f"; per seed adaptive / {best}: " + ", ".join(
                f"{x:.2f}" if x is not None else f"{who} never" for x, who in paired_ratios(runs, adaptive, best))
        if c["check"].startswith("final_accuracy") and short is not None:
            c["detail"] = f"median shortfall against each seed's dense run {100 * short:+.2f} pp " \
                          f"(per seed: {', '.join(f'{100 * x:+.2f}' for x in shortfalls)})"
        if c["check"] == "no_decision_dips_below_static":
            c["detail"] += f" (every decision of {len(runs)} seeds)"
        else:
            c["detail"] += f" (median of {len(runs)} seeds)" if not c["check"].startswith("decisions") and \
                not c["check"].startswith("no_decisions") else f" (worst of {len(runs)} seeds)"
    # Beside the medians: the same comparisons with each seed its own control (paired_checks).
    at = next(i for i, c in enumerate(out) if not c["check"].startswith("time_"))
    out[at:at] = paired_checks(profile, runs, static_settings, adaptive, best)
    return out


def paired_ratios(runs, setting, baseline):
    """Per seed (in seed order), (setting's time to target / baseline's, None) — the same seed's
    data, order and initialisation on both sides, so the spread shows what one comparison is
    worth — or (None, the side that never got there: setting first) where one did not."""
    out = []
    for seed in sorted(runs, key=lambda k: int(k) if str(k).isdigit() else str(k)):
        a = runs[seed].get(setting, {}).get("time_to_target_s")
        b = runs[seed].get(baseline, {}).get("time_to_target_s")
        out.append((a / b, None) if a is not None and b else (None, setting if a is None else baseline))
    return out


def job_order(settings, k):
    """The order seed number k (0, 1, ...) of a run runs its settings in: `settings` rotated by k,
    so that each setting runs first, second, ... on as many seeds as the others. A fixed order
    put the adaptive job right after top-k's on every seed, and a drift of the host within a
    seed's jobs (its trainers computed x1.02-1.11 slower in three calls of 2026-12-01) would then
    read as the setting's cost."""
    settings = list(settings)
    if not settings:
        return []
    k %= len(settings)
    return settings[k:] + settings[:k]


def median_step_s(entry, skip=20):
    """A job's pace: the median of its step times after its first `skip` steps (step_end_s, the
    seconds from the first step's start to each step's end; the median leaves out evaluations and
    stalls), None with fewer than two steps after them."""
    return _median_step((entry.get("step_end_s") or [])[skip:])


def _median_step(t):
    """The median of the differences of consecutive step ends `t`, None with fewer than two ends."""
    d = sorted(b - a for a, b in zip(t, t[1:]))
    if not d:
        return None
    mid = len(d) // 2
    return d[mid] if len(d) % 2 else (d[mid - 1] + d[mid]) / 2


def compute_median_s(entry):
    """The trainers' own compute per step over a job (their median), None where not reported."""
    c = entry.get("compute_seconds")
    v = c.get("median") if isinstance(c, dict) else None
    return v if isinstance(v, (int, float)) and v > 0 else None


# What ddp_digits.py's --report-compute-time splits a trainer's step into (compute_parts; rank
# 0's): its medians of forward, backward and the optimizer, and what its training thread waited
# for a CPU per step (/proc's schedstat).
COMPUTE_PARTS = ("forward", "backward", "optimizer", "cpu_wait_per_step")


def compute_part(part):
    """A function of a job's entry: its trainers' compute_parts[part] (s), None where not reported
    or not positive."""
    def value(entry):
        c = entry.get("compute_parts")
        v = c.get(part) if isinstance(c, dict) else None
        return v if isinstance(v, (int, float)) and v > 0 else None
    return value


def paired_values(runs, setting, baseline, value):
    """Per seed (in seed order) value(setting's job) / value(baseline's job), where both are known:
    e.g. median_step_s or compute_median_s, to tell the host's noise (the trainers' own compute
    moving between jobs) from what a setting costs a step."""
    out = []
    for seed in sorted(runs, key=lambda k: int(k) if str(k).isdigit() else str(k)):
        a, b = runs[seed].get(setting), runs[seed].get(baseline)
        x, y = (value(a) if a else None), (value(b) if b else None)
        if x and y:
            out.append(x / y)
    return out


def paired_interval(ratios):
    """(geometric mean, low, high) of per-seed ratios (one setting's time over another's, same
    seed) with the two-sided PAIRED_LEVEL interval of Student's t on their logs — what the seeds
    say the ratio of the two settings is, each seed its own control; None with fewer than two."""
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    if n < 2:
        return None
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    t = _T95[n - 2] if n - 2 < len(_T95) else 1.645
    half = t * sd / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def paired_checks(profile, runs, static_settings, adaptive, best):
    """The time checks on seeds paired: the adaptive setting's time over the same seed's time of
    a static one, summarised by paired_interval. PASS where the whole interval is inside the
    bound, FAIL where the whole of it is outside, N/A where it straddles the bound (the seeds
    cannot tell). Seeds where either side never reached the target are left out and counted."""
    out = []

    def summary(baseline):
        pairs = paired_ratios(runs, adaptive, baseline)
        ratios = [x for x, _ in pairs if x is not None]
        missing = len(pairs) - len(ratios)
        return paired_interval(ratios), len(ratios), missing

    def text(baseline, iv, n, missing):
        left = f"; {missing} seed(s) left out (one side never reached the target)" if missing else ""
        if iv is None:
            return f"adaptive / {baseline}: {n} seed(s) with both times, too few{left}"
        g, lo, hi = iv
        return f"adaptive / {baseline}: geometric mean {g:.3f}, {100 * PAIRED_LEVEL:.0f} % interval " \
               f"{lo:.3f}-{hi:.3f} over {n} seeds{left}"

    if best is None:
        out.append(check("time_within_5pct_paired", None, "no static setting reached the target"))
    else:
        iv, n, missing = summary(best)
        ok = None if iv is None else (True if iv[2] <= 1.0 + TTA_SLACK else (False if iv[1] > 1.0 + TTA_SLACK else None))
        out.append(check("time_within_5pct_paired", ok, text(best, iv, n, missing) + f" (bound {1 + TTA_SLACK:.2f})"))
    if profile in CHANGING_PROFILES:
        parts, verdicts = [], []
        for s in sorted(static_settings):
            if not any(s in r for r in runs.values()):
                continue
            iv, n, missing = summary(s)
            parts.append(text(s, iv, n, missing))
            verdicts.append(None if iv is None else (True if iv[2] < 1.0 else (False if iv[1] >= 1.0 else None)))
        ok = False if False in verdicts else (True if verdicts and all(v is True for v in verdicts) else None)
        out.append(check("time_beats_every_static_paired", ok, "; ".join(parts) or "no static setting"))
    return out


def _bound(holds, partial):
    """FAIL when broken; N/A when it held only on part of the job; else PASS."""
    return False if not holds else (None if partial else True)


def finite_or_none(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def static_of(daemon_args, densities):
    """The static top-k setting ("topk" + a key of densities: {name: density}) that runs the plan
    a controller's daemon arguments ask for (--selector topk, the default, at its --density), or
    None: "topk0.5" for --selector topk --density 0.005 with densities {"0.5": 0.005}."""
    opts = _options(daemon_args)
    if opts.get("--selector", "topk") != "topk" or "--density" not in opts:
        return None
    try:
        density = float(opts["--density"])
    except ValueError:
        return None
    return next((f"topk{name}" for name, d in densities.items() if abs(d - density) <= 1e-12), None)


def _options(daemon_args):
    """{"--flag": value} of daemon arguments ("--flag value" or "--flag=value"; the last wins)."""
    opts = {}
    for i, a in enumerate(daemon_args):
        key, _, val = a.partition("=")
        if key.startswith("--"):
            opts[key] = val or (daemon_args[i + 1] if i + 1 < len(daemon_args) else "")
    return opts


def warmup_steps_of(daemon_args):
    """The schedule's dense warm-up (steps) that daemon arguments configure: --schedule-warmup-steps
    where --controller names schedule; 0 otherwise."""
    opts = _options(daemon_args)
    if "schedule" not in opts.get("--controller", "").split(","):
        return 0
    return int(opts.get("--schedule-warmup-steps", 0))
