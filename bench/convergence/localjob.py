"""Runs a sparsecar job on this machine: N sparsecard daemons on loopback and the trainer
processes of every node, each in its own process group, all stopped on exit (also on errors,
Ctrl-C and SIGTERM). Used by bench/convergence/ and tests/integration/python/.

    with LocalJob(sparsecard, nodes=2, local_clients=2, daemon_args=["--density", "0.005"]) as job:
        job.start_daemons()
        procs = [job.spawn(f"trainer {r}", [python, "train.py", ...], env=...) for r in range(4)]
        job.wait_all(procs, timeout=300)

Standard library only; runs under Debian's /usr/bin/python3.
"""

import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from procset import ProcessError, ProcessSet  # noqa: E402


def machine():
    """What a benchmark ran on, for its report: host, CPUs and their model, kernel, Python, and
    the GPUs and their links where nvidia-smi answers."""
    info = {"host": platform.node(), "cpus": os.cpu_count(), "cpu": None, "kernel": platform.release(),
            "python": platform.python_version()}
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            info["gpus"] = [line.strip() for line in r.stdout.splitlines() if line.strip()]
        t = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True)
        if t.returncode == 0:
            info["gpu_topology"] = t.stdout
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
            info["cpu"] = m.group(1).strip() if m else None
    except OSError:
        pass
    return info


def cpu_seconds_of_stat(stat, ticks_per_s):
    """User + system CPU seconds of a process (all its threads) from the text of /proc/PID/stat:
    fields 14 and 15, counted after the command name's closing parenthesis (the name may hold
    spaces and parentheses itself). None if the text is not such a line."""
    rest = stat[stat.rfind(")") + 1:].split()
    try:
        return (int(rest[11]) + int(rest[12])) / ticks_per_s
    except (IndexError, ValueError):
        return None


def cpu_seconds(pid):
    """User + system CPU seconds process `pid` has used so far (Linux), or None where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return cpu_seconds_of_stat(f.read(), os.sysconf("SC_CLK_TCK"))
    except OSError:
        return None


class JobError(ProcessError):
    """Something of the job failed; the message names the process and quotes its log."""


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path, lines=25):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)\n"


# Launcher variables of an outer job must not leak into the daemons (they read NODE_RANK etc.).
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "NODE_RANK", "NNODES", "SPARSECAR_NODE_RANK", "SPARSECAR_NNODES", "SPARSECAR_LOCAL_WORLD_SIZE",
                  "SPARSECAR_SOCKET", "SPARSECAR_COORDINATOR")


class LocalJob:
    def __init__(self, sparsecard, nodes=2, local_clients=1, daemon_args=(), workdir=None, keep=False):
        self.sparsecard = sparsecard
        self.nodes = nodes
        self.local_clients = local_clients
        self.daemon_args = list(daemon_args)
        self._own_dir = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix="sparsecar-job-")
        self.keep = keep
        self.processes = ProcessSet()
        self.daemons = []
        self.sockets = [os.path.join(self.dir, f"node-{r}.sock") for r in range(nodes)]
        self._old_handlers = {}

    # ---- lifetime ------------------------------------------------------------------------------
    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc):
        self.stop_all()
        for sig, h in self._old_handlers.items():
            signal.signal(sig, h)
        if self._own_dir and not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        return False

    def _on_signal(self, signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def spawn(self, name, argv, env=None, log_name=None):
        log_path = os.path.join(self.dir, (log_name or name.replace(" ", "-")) + ".log")
        try:
            return self.processes.start(name, argv, env, log_path)
        except ProcessError as e:
            raise JobError(str(e)) from e

    def log_of(self, p):
        return self.processes.log_of(p)

    def stop_all(self, grace_s=5.0):
        """SIGTERM every process group we started, SIGKILL after grace_s; returns names killed."""
        _, killed = self.processes.stop_all(grace_s)
        self.daemons = []
        return killed

    # ---- daemons ------------------------------------------------------------------------------
    def daemon_env(self):
        env = dict(os.environ)
        for k in _LAUNCHER_VARS:
            env.pop(k, None)
        env.setdefault("UCX_TLS", "tcp")
        env.setdefault("UCX_NET_DEVICES", "lo")
        return env

    def start_daemons(self, timeout=60.0):
        port = free_port()
        env = self.daemon_env()
        for r in range(self.nodes):
            argv = [self.sparsecard, "--rank", str(r), "--world-size", str(self.nodes),
                    "--coordinator", f"127.0.0.1:{port}", "--socket", self.sockets[r],
                    "--local-clients", str(self.local_clients), "--metrics-listen", "off",
                    "--control", f"ipc://{self.dir}/control-{r}.sock",
                    "--log-level", "warn"] + self.daemon_args
            self.daemons.append(self.spawn(f"sparsecard node {r}", argv, env=env, log_name=f"sparsecard-{r}"))
        self.wait_for_sockets(timeout)

    def check_daemons(self, when="during the job"):
        for r, d in enumerate(self.daemons):
            if d.poll() is not None:
                raise JobError(f"sparsecard node {r} exited with status {d.returncode} {when}:\n"
                               f"{tail(self.log_of(d))}")

    def wait_for_sockets(self, timeout):
        """Waits (bounded) until every daemon's session socket in self.sockets exists; a daemon
        that exits meanwhile is reported with its log."""
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(s) for s in self.sockets):
            self.check_daemons("while starting")
            if time.monotonic() > deadline:
                raise JobError(f"daemon sockets did not appear within {timeout:.0f} s")
            time.sleep(0.05)

    # ---- trainers -----------------------------------------------------------------------------
    def wait_all(self, procs, timeout):
        """Waits until every process in procs exited 0; raises JobError naming the first failure
        (with its log) or a timeout. Daemons dying meanwhile are reported too."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            bad = [p for p in procs if p.poll() not in (None, 0)]
            if bad:
                break
            if time.monotonic() > deadline:
                raise JobError(f"processes did not finish within {timeout:.0f} s:\n" + "".join(
                    f"--- {self.log_of(p)}:\n{tail(self.log_of(p))}" for p in procs if p.poll() is None))
            time.sleep(0.05)
        bad = [p for p in procs if p.poll() not in (None, 0)]
        if bad:
            msg = []
            for p in bad:
                msg.append(f"--- {self.log_of(p)} (status {p.returncode}):\n{tail(self.log_of(p))}")
            for d in self.daemons:
                msg.append(f"--- {self.log_of(d)} (status {d.poll()}):\n{tail(self.log_of(d), 10)}")
            raise JobError("a process failed:\n" + "\n".join(msg))
