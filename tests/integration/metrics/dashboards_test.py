#!/usr/bin/env python3
"""Live check of the metrics, the Grafana dashboard and the alert rules.

Starts a 2-node sparsecard job on loopback (metrics on free ports), one load trainer per node,
Debian's prometheus scraping both every second with dashboards/prometheus/alerts.yml loaded;
pauses and resumes compression through sparsecarctl so sparse and dense steps both happen; then
  * `promtool check metrics` on a live scrape of each daemon,
  * every dashboard panel's PromQL ($__rate_interval, $instance substituted) must return a
    non-empty result whose values are all finite, and so must every annotation's (the pause and
    resume are controller decisions),
  * every alert rule's expression, with its comparisons made `bool`, likewise,
  * prometheus reports every rule group healthy.
Everything it starts runs in its own process group and is killed on exit.
"""
import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ports import free_ports  # noqa: E402  (tests/integration/ports.py)

procs = []


def start(cmd, log):
    p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    procs.append(p)
    return p


def stop_all():
    for p in reversed(procs):
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + 10
    for p in reversed(procs):
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_for(what, fn, timeout):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            v = fn()
            if v:
                return v
        except Exception as e:  # not up yet
            last = e
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what} ({last})")


def query(prom, expr):
    url = f"http://{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        body = json.loads(http_get(url))
    except urllib.error.HTTPError as e:
        return None, f"HTTP {e.code}: {e.read().decode()[:300]}"
    if body.get("status") != "success":
        return None, body.get("error", "error")
    return body["data"], None


def check_result(data):
    """Non-empty, every value finite."""
    kind, result = data["resultType"], data["result"]
    if kind == "scalar":
        values = [result[1]]
    else:
        values = [r["value"][1] for r in result]
    if not values:
        return "empty result"
    bad = [v for v in values if not math.isfinite(float(v))]
    return f"non-finite values {bad}" if bad else None


COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)(\s*)(-?[0-9][0-9.]*(?:e[+-]?[0-9]+)?)")


def as_bool(expr):
    return COMPARISON.sub(lambda m: f"{m.group(1)} bool {m.group(3)}", expr)


def main():
    ap = argparse.ArgumentParser()
    for a in ("sparsecard", "sparsecarctl", "trainer", "prometheus", "promtool", "dashboards"):
        ap.add_argument("--" + a, required=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--sleep-ms", type=int, default=25)
    ap.add_argument("--seconds", type=float, default=8, help="time between the control actions (total)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="sparsecar-metrics-")
    failures = []
    try:
        coordinator_port, *metrics_ports, prom_port = free_ports(4)
        coordinator = f"127.0.0.1:{coordinator_port}"
        for r in range(2):
            start([args.sparsecard, "--rank", str(r), "--world-size", "2", "--coordinator", coordinator,
                   "--socket", f"{tmp}/rank-{r}.sock", "--metrics-listen", f"127.0.0.1:{metrics_ports[r]}",
                   "--ucx-tls", "tcp", "--ucx-net-devices", "lo", "--join-timeout-ms", "20000",
                   "--density", "0.01"], f"{tmp}/rank-{r}.log")
        for r in range(2):
            wait_for(f"rank {r}", lambda r=r: os.path.exists(f"{tmp}/rank-{r}.sock"), 30)
        ctl = lambda r, *a: subprocess.run([args.sparsecarctl, "--endpoint", f"ipc://{tmp}/rank-{r}-control.sock", *a],
                                           capture_output=True, text=True, timeout=30)
        status = json.loads(ctl(0, "--json", "status").stdout)
        assert status["result"]["metrics_port"] == metrics_ports[0], status

        prom = f"127.0.0.1:{prom_port}"
        rules = os.path.join(args.dashboards, "prometheus", "alerts.yml")
        shutil.copy(rules, f"{tmp}/alerts.yml")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["alerts.yml"],
            "scrape_configs": [{"job_name": "sparsecar",
                                "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in metrics_ports]}]}],
        }
        with open(f"{tmp}/prometheus.yml", "w") as f:
            yaml.safe_dump(config, f)
        subprocess.run([args.promtool, "check", "config", f"{tmp}/prometheus.yml"], check=True,
                       capture_output=True)
        start([args.prometheus, f"--config.file={tmp}/prometheus.yml", f"--storage.tsdb.path={tmp}/data",
               f"--web.listen-address={prom}", "--log.level=warn"], f"{tmp}/prometheus.log")
        wait_for("prometheus", lambda: http_get(f"http://{prom}/-/ready"), 30)
        # Ready is not scraping: its discovery hands the targets over up to ~5 s later. A scrape of
        # both daemons before the load starts, so that every decision below changes a value that
        # was scraped before it (the decision annotations are changes()); without it one run in
        # three saw the three decisions land before the first scrape.
        wait_for("first scrapes", lambda: (query(prom, 'count(up{job="sparsecar"} == 1) >= 2')[0] or {})
                 .get("result"), 30)

        trainers = [start([args.trainer, f"{tmp}/rank-{r}.sock", str(args.steps), str(args.sleep_ms)],
                          f"{tmp}/trainer-{r}.log")
                    for r in range(2)]
        time.sleep(args.seconds / 3)
        for cmd in (("pause",), ("set", "density=0.05"), ("resume",)):
            out = ctl(1, *cmd)
            if out.returncode != 0:
                failures.append(f"sparsecarctl {' '.join(cmd)}: {out.stdout}{out.stderr}")
            time.sleep(args.seconds / 6)
        ctl(0, "report-metric", "val_accuracy", "0.9", "1")
        for t in trainers:
            t.wait(timeout=120)
            if t.returncode != 0:
                failures.append(f"trainer exited {t.returncode}")

        # A few more scrapes after the load, then lint the exposition itself.
        wait_for("scrapes", lambda: (query(prom, 'min(count_over_time(up{job="sparsecar"}[1m])) >= 8')[0] or {})
                 .get("result"), 30)
        for p in metrics_ports:
            text = http_get(f"http://127.0.0.1:{p}/metrics")
            lint = subprocess.run([args.promtool, "check", "metrics"], input=text, capture_output=True, text=True)
            if lint.returncode != 0:
                failures.append(f"promtool check metrics (port {p}): {lint.stdout}{lint.stderr}")

        dashboard = json.load(open(os.path.join(args.dashboards, "grafana", "sparsecar.json")))
        checked = 0
        for panel in dashboard["panels"]:
            if not panel.get("fieldConfig", {}).get("defaults", {}).get("unit"):
                failures.append(f"panel '{panel['title']}' has no unit")
            for target in panel.get("targets", []):
                # The whole run fits in 10m: every series has data in the window however slow the box.
                expr = target["expr"].replace("$__rate_interval", "10m").replace("$instance", ".*")
                data, err = query(prom, expr)
                err = err or check_result(data)
                checked += 1
                if err:
                    failures.append(f"panel '{panel['title']}' {target['refId']}: {err}\n    {expr}")
        # Annotations (controller decisions, decision epochs): the pause/resume above makes both fire.
        for annotation in dashboard.get("annotations", {}).get("list", []):
            if "expr" not in annotation:
                continue
            expr = annotation["expr"].replace("[1m]", "[10m]").replace("$instance", ".*")
            data, err = query(prom, expr)
            err = err or check_result(data)
            checked += 1
            if err:
                failures.append(f"annotation '{annotation['name']}': {err}\n    {expr}")
        for group in yaml.safe_load(open(rules))["groups"]:
            for rule in group["rules"]:
                expr = as_bool(rule["expr"])
                data, err = query(prom, expr)
                err = err or check_result(data)
                checked += 1
                if err:
                    failures.append(f"alert {rule.get('alert')}: {err}\n    {expr}")
        health = json.loads(http_get(f"http://{prom}/api/v1/rules"))["data"]["groups"]
        for g in health:
            for r in g["rules"]:
                if r.get("health") != "ok":
                    failures.append(f"rule {r.get('name')}: health {r.get('health')} {r.get('lastError')}")
        print(f"checked {checked} expressions against a live 2-node job")
    except BaseException as e:
        failures.append(f"{type(e).__name__}: {e}")
    finally:
        stop_all()
        if failures:
            for f in sorted(os.listdir(tmp)):
                if f.endswith(".log"):
                    print(f"---- {f} ----\n" + open(os.path.join(tmp, f)).read()[-3000:])
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
