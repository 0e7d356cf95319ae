"""Two network namespaces joined by one veth pair, each end shaped by `tc tbf` (used by
bench/convergence/capped.py; needs root).

    with CappedLink("100mbit") as link:
        link.exec_argv(0, ["sparsecard", ...])     # ["ip", "netns", "exec", <ns of node 0>, ...]
        link.addr[0], link.dev[0]                  # 10.77.0.1, the veth end inside node 0's ns
        link.set_rate("50mbit")                    # both ends, while traffic flows

Everything it creates carries this process's pid in its name; teardown deletes exactly the
namespaces it created (which removes the veth pair with them) and nothing else. It runs on
normal exit, on exceptions (KeyboardInterrupt included: LocalJob turns SIGINT/SIGTERM into one)
and at interpreter exit. Standard library only; runs under Debian's /usr/bin/python3.
"""

import atexit
import os
import re
import subprocess
import threading
import time

SUBNET = "10.77.0"  # inside our own namespaces only: cannot clash with the host's routes


def rate_bits(rate):
    """'100mbit' -> 1e8 (tc's units: kbit, mbit, gbit; decimal)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)?bit", rate.strip().lower())
    if not m:
        raise ValueError(f"rate '{rate}' is not like 100mbit or 1gbit")
    return float(m.group(1)) * {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


# The burst floor of a link whose rate changes (CappedLink(min_burst=...), set_rate): tbf never
# sends a queued packet larger than its burst, and packets queued under a faster rate's burst are
# GSO super-packets of up to 64 KiB + headers; with 32 KiB after a change to 50mbit a TCP stream
# stalled for good (measured: 2-47 packets of ~68 KB stuck in the backlog, nothing sent).
CHANGING_MIN_BURST = 128 * 1024


def tbf_params(rate, min_burst=32 * 1024):
    """burst and latency for a tbf that holds `rate`: a burst of ~2 ms of traffic (>= min_burst,
    32 KiB by default, so that one TSO/GSO super-packet passes without being split into many) and
    a queue of ~20 ms."""
    bps = rate_bits(rate)
    burst = max(min_burst, int(bps / 8 * 0.002))
    return {"rate": rate, "burst": f"{burst}b", "latency": "20ms"}


def _run(argv, check=True):
    r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


class CappedLink:
    def __init__(self, rate, nodes=2, tag=None, min_burst=32 * 1024):
        if nodes != 2:
            raise ValueError("CappedLink joins exactly 2 namespaces (one veth pair)")
        tag = tag or str(os.getpid())
        self.rate = rate
        self.min_burst = min_burst  # CHANGING_MIN_BURST for a link that will set_rate()
        self.tbf = tbf_params(rate, min_burst)
        self.ns = [f"sccap-{tag}-a", f"sccap-{tag}-b"]
        self.dev = [f"scv{tag}a", f"scv{tag}b"]  # IFNAMSIZ: <= 15 characters
        if any(len(d) > 15 for d in self.dev):
            raise ValueError(f"tag '{tag}' makes interface names longer than 15 characters")
        self.addr = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self._created = []  # namespaces we created, for teardown
        self._lock = threading.Lock()

    def __enter__(self):
        atexit.register(self.teardown)
        try:
            self._setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc):
        self.teardown()
        return False

    def _setup(self):
        for ns in self.ns:
            if _run(["ip", "netns", "list"]).stdout.split().count(ns):
                raise RuntimeError(f"namespace {ns} already exists (not ours; refusing to touch it)")
        for ns in self.ns:
            _run(["ip", "netns", "add", ns])
            self._created.append(ns)
        # Created inside namespace a with its peer placed in b at once: nothing appears in the
        # caller's namespace.
        _run(["ip", "-n", self.ns[0], "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1],
              "netns", self.ns[1]])
        for i, ns in enumerate(self.ns):
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", self.dev[i]])
            _run(["ip", "-n", ns, "link", "set", self.dev[i], "up"])
            _run(["tc", "-n", ns, "qdisc", "add", "dev", self.dev[i], "root", "tbf", "rate", self.tbf["rate"],
                  "burst", self.tbf["burst"], "latency", self.tbf["latency"]])

    def teardown(self):
        with self._lock:
            while self._created:
                ns = self._created.pop()
                _run(["ip", "netns", "del", ns], check=False)  # removes its veth end (and so the pair)

    def set_rate(self, rate):
        """Changes both ends' tbf to `rate` (burst and queue as at creation: tbf_params) while
        traffic flows: `tc qdisc change` keeps the qdisc, its backlog and its counters. Returns
        when both ends run the new rate (node 0's end first, node 1's a few ms later). Create the
        link with min_burst=CHANGING_MIN_BURST: a packet queued under the old rate that is larger
        than the new burst is never sent, and the link stalls."""
        if self.min_burst < CHANGING_MIN_BURST:
            raise ValueError("set_rate needs a link created with min_burst >= CHANGING_MIN_BURST")
        tbf = tbf_params(rate, self.min_burst)
        for i, ns in enumerate(self.ns):
            _run(["tc", "-n", ns, "qdisc", "change", "dev", self.dev[i], "root", "tbf", "rate", tbf["rate"],
                  "burst", tbf["burst"], "latency", tbf["latency"]])
        self.rate, self.tbf = rate, tbf

    def exec_argv(self, node, argv):
        return ["ip", "netns", "exec", self.ns[node]] + list(argv)

    def qdisc_stats(self, node):
        return _run(["tc", "-n", self.ns[node], "-s", "qdisc", "show", "dev", self.dev[node]]).stdout

    def measure(self, python, seconds=2.0):
        """Goodput of one TCP stream from node 0 to node 1 in Mbit/s (checks that the cap holds).
        `python`: the interpreter, or an argv that starts one (e.g. ["env", "-u", "VAR", "python3"])."""
        port = 5201
        python = [python] if isinstance(python, str) else list(python)
        rx = subprocess.Popen(self.exec_argv(1, [*python, "-c", _RX, self.addr[1], str(port)]),
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            time.sleep(0.5)
            tx = subprocess.run(self.exec_argv(0, [*python, "-c", _TX, self.addr[1], str(port), str(seconds)]),
                                capture_output=True, text=True, timeout=seconds + 30)
            if tx.returncode != 0:
                raise RuntimeError(f"link check sender failed: {tx.stderr.strip()}")
            out, _ = rx.communicate(timeout=30)
            nbytes, dt = out.split()
            return 8 * int(nbytes) / float(dt) / 1e6
        finally:
            if rx.poll() is None:
                os.killpg(rx.pid, 9)
                rx.wait()


_RX = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.monotonic()
    n += len(b)
print(n, time.monotonic() - t0)
"""

_TX = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
buf = b"x" * (1 << 20); end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end: c.sendall(buf)
c.close()
"""
