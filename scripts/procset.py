"""ProcessSet: processes a launcher started, each the leader of its own process group, and the
one way to stop them all (SIGTERM, then SIGKILL after a grace period, groups included).

Shared by scripts/run_demo.py and bench/convergence/localjob.py. Standard library only.
"""

import os
import signal
import subprocess
import time


class ProcessError(Exception):
    """A process could not be started or failed."""


class ProcessSet:
    def __init__(self):
        self.procs = []  # (name, Popen, log path) of the processes not yet stopped
        self.pids = []   # every pid ever started, for leftover checks

    def start(self, name, argv, env, log_path, pipe_stdout=False):
        """Starts argv in a new session; output goes to log_path (stdout to a pipe if asked)."""
        with open(log_path, "w") as log_file:
            try:
                p = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE if pipe_stdout else log_file,
                                     stderr=log_file if pipe_stdout else subprocess.STDOUT,
                                     env=env, start_new_session=True, text=True, bufsize=1)
            except OSError as e:
                raise ProcessError(f"cannot start {name} ({argv[0]}): {e}") from e
        self.procs.append((name, p, log_path))
        self.pids.append(p.pid)
        return p

    def log_of(self, p):
        for _, q, path in self.procs:
            if q is p:
                return path
        return None

    def stop_all(self, grace_s=5.0):
        """SIGTERM every group still running, then SIGKILL what is left after grace_s.
        Returns ({name: returncode} of every process, [names that had to be killed])."""
        for _, p, _ in self.procs:
            if p.poll() is None:
                signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, p, _ in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        killed = []
        for name, p, _ in self.procs:
            if p.poll() is None:
                killed.append(name)
            # Also reap anything the leader left in its group.
            signal_group(p, signal.SIGKILL)
        for _, p, _ in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if p.stdout:
                p.stdout.close()
        codes = {name: p.returncode for name, p, _ in self.procs}
        self.procs = []
        return codes, killed


def signal_group(p, sig):
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
