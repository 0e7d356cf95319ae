"""PyTorch DistributedDataParallel communication hook that sends gradients through sparsecar.

    model = torch.nn.parallel.DistributedDataParallel(net)       # gloo (or nccl) process group
    hook = sparsecar.torch.register(model, socket="/run/sparsecar/sparsecard.sock", optimizer=opt)
    ...
    loss.backward(); opt.step(); hook.report_metric("loss", loss.item())

How it works (torch 1.13 .. 2.x; only public, long-lived hook APIs are used):

* **Buckets or parameters.** By default (``tensors="buckets"``) each DDP bucket is one flat
  sparsecar tensor (``"<prefix>.<index>"``, default prefix ``ddp.bucket``): one top-k over the
  whole bucket, the layout the convergence evidence (docs/convergence.md) was measured with.
  With ``tensors="parameters"`` each parameter of a bucket is registered as its own sparsecar
  tensor, under its name from ``model.named_parameters()`` and with its shape (up to 4 dims; more
  are registered flat), so a config's ``[tensor."layer1.*"]`` overrides and the shaped selectors
  (``row_topk``, ``channel_topk``, ``head_topk`` ...) apply to DDP jobs as to any trainer; the
  bucket's buffer holds the parameters' gradients back to back in the order of
  ``GradBucket.parameters()`` and each one is copied into (and back out of) its own slot. Top-k
  per parameter at one global density ended 1 pp less accurate than per bucket on the digits MLP
  (docs/convergence.md): give layers their own densities when you choose it.
* **Registered once the bucket layout is stable.** DDP rebuilds its buckets after the first
  iteration (in the order gradients became ready), and sparsecar needs every tensor registered
  before its first step. So the hook runs the first ``dense_iterations`` iterations (default 2, at
  least 2) as a plain all-reduce on DDP's process group and records which parameters each bucket
  holds; at the last bucket of the first iteration whose buckets are DDP's final ones — the
  second, where the rebuild changed them (a model of more than DDP's first bucket, 1 MiB: every
  real one), else the first that holds the same sizes and the same parameters as the previous
  one's (the rebuild may only reorder them) from the iteration of the rebuild on (the second;
  with ``static_graph=True`` DDP rebuilds in the third) — it registers every parameter in this
  iteration's order, bucket by bucket, and every rank agrees (one tiny all-reduce) that all of
  them did. From the next iteration on every bucket goes to the daemon;
  a bucket whose parameters are not the registered ones in the registered order fails that step
  (and the hook falls back, agreed as below) instead of mixing gradients up.
* **The hook returns at once.** It copies the bucket into the shared-memory slots, submits them
  (with the learning rate) and returns a ``torch.futures.Future``; one completion thread per
  process waits for the daemon in bucket order, copies the averages back into the bucket and
  completes the future. DDP's ``backward()`` waits for the futures.
* **GPU buckets stay on the GPU** (``device_path="auto"``, the default). Each bucket (or
  parameter slice) gets a float32 buffer on its GPU that the daemon maps by CUDA IPC, with two
  interprocess events: per step the hook copies the bucket into it on the current stream (a cast
  for float16/bfloat16 buckets), records ``ready`` and submits; the daemon's stream waits on
  ``ready``, compresses on its GPU (error-feedback residual there too), sends only the encoded
  payload and writes the average back, then records ``done``; the completion thread's stream waits
  on ``done``, copies the average into the bucket, and the future (created with ``devices=``)
  carries that stream to DDP. No host thread waits for a GPU. A daemon built without CUDA (or
  without a GPU) refuses GPU tensors: the hook then warns once and stages through host memory
  (``summary()["path"]`` says which).
* **Dense steps through DDP's own group, where the daemons ask.** Every submit says the hook can
  all-reduce a dense step itself; with the daemons' ``dense_collective=trainer`` a dense step
  comes back as this rank's share of its node's part (StepInfo.trainer_reduces, alike on every
  rank), and after the agreement below the completion thread all-reduces those buckets over
  DDP's process group and divides by its size (on the device path on the sync stream). On GPUs
  that is NCCL instead of the daemons' host-staged ring.
* **Leases.** Such a step also says how many of the next steps are trainer-reduced dense steps
  as well under the decision in force (StepInfo.lease_steps: 1, 2, 4, ... with each such step in
  a row, at most the daemons' knob ``trainer_lease``, default 16). The agreement below carries
  the least lease of every slice on every rank, and the next that many iterations all-reduce
  every bucket over DDP's group at once, as DDP's own hook does, without submitting them: no
  round trip through the daemon, no agreement (on GPUs the round trip, not the all-reduce, made
  a trainer-reduced step cost what a sparse one does). The daemons take the next submitted step,
  whatever its number; a decision they made meanwhile takes effect there. A lease only ever
  skips dense steps, which need nothing of the daemon (its residual was handed over with the
  step that granted it).
* **Fallback, agreed.** If the daemon is unreachable when registering or a step fails, the hook
  logs the real cause (torch itself would only say "Unable to cast ..."), warns once, and uses
  plain all-reduce from then on; ``on_error="raise"`` fails the step instead. A failure may be
  seen by some ranks only (a node can complete a step just before a peer's abort reaches it, or
  one rank's wait deadline passes), so the ranks agree before any bucket of an iteration is
  handed back: the completion thread waits for every bucket of the iteration, then one tiny
  all-reduce tells every rank whether all of them got every bucket. If so, the daemon's averages
  are used; if not, every rank all-reduces the original gradients of that whole iteration (they
  are still in the buckets) and every rank falls back from the next iteration on. So the
  parameters stay identical on every rank, whatever failed where.
* **Agreement on any backend, without a GPU sync.** The agreement all-reduces (one int32) need
  a backend that takes the tensor: with ``agreement="auto"`` (the default) a job whose default
  group is NCCL gets a gloo side group (``dist.new_group(backend="gloo")``, created by register()
  on every rank, over the same rendezvous) and agrees with a CPU tensor through it, so the
  completion thread never waits for a GPU stream (an NCCL all-reduce plus ``.item()`` would wait
  for everything queued on the GPU before it). ``agreement="device"`` (and "auto" with a
  ``process_group=`` subgroup, or when gloo is missing) all-reduces on the device of the
  model's parameters / the bucket through DDP's own group: under NCCL a CUDA tensor (a CPU
  tensor would fail there with "No backend type associated with device type cpu").
  ``summary()["agreement"]`` says which. Futures of CUDA buckets are created with ``devices=``
  so torch syncs the streams.
* **Node values are not process values.** torchrun's RANK / WORLD_SIZE / LOCAL_RANK are per
  process; a sparsecar daemon serves a node. The node rank and node count the hook shows come
  from ``SPARSECAR_NODE_RANK`` / ``SPARSECAR_NNODES`` (else ``NODE_RANK`` / ``NNODES``), the
  names the daemon reads too (see :func:`node_rank`, :func:`nnodes`).
* **Feedback.** When the buckets switch to sparsecar, rank 0 prints one line to stderr (shown by
  default; ``announce="all"`` prints it on every rank with its rank, ``announce=None`` never).
  ``hook.summary()`` returns the totals: iterations, bytes sent vs. a dense exchange, the ratio,
  the density and the mean step and exchange time. ``hook.stats`` has the raw counters:
  the daemon-reported wire bytes of this node (``sparsecar_bytes``), the dense-equivalent bytes
  it reports, and the elements that went through the dense path (warm-up and fallback).
* **Momentum correction** (``momentum_correction=True``, DGC's, Lin et al. 2018). Error
  feedback sends what it held back in bursts, and a trainer's SGD momentum then applies each
  burst ~1/(1-m) times: a dense -> sparse switch cost up to 16 pp test accuracy on the digits job
  (docs/convergence.md section 4). With the option the hook takes the momentum m out of the
  ``optimizer=`` (a torch.optim.SGD, one m > 0 in every group, dampening 0, no nesterov: it sets
  their momentum to 0, drops their momentum buffers and logs one line) and keeps a float32
  velocity u per bucket on the bucket's device, per trainer (a node's local sum is linear in u).
  Each bucket's gradient g is replaced by u = m*u + g before anything is sent: the hook's own
  all-reduce (warm-up, fallback), host staging, or the device path's float32 buffer. A dense
  step (every coordinate went out: the hook's all-reduce, or the daemon reporting nnz = numel)
  makes the averaged u the update, which is SGD with momentum exactly; the first daemon dense step
  after sparse ones (a controller's switch to the ring) also sent the daemon's residual, every
  coordinate with the velocity it had held back, so u restarts there everywhere, as where a
  sparse step sent (measured: +1.9 pp test accuracy over the 16 steps after an early switch
  against keeping u, 12 seeds; docs/controllers.md). After a sparse step u is
  zeroed where the returned average is nonzero (DGC's momentum factor masking: those
  coordinates went out; the daemon's residual keeps the unsent rest of u), before the bucket's
  future is fulfilled. With several nodes the average's support is the union of the nodes'
  selections, so a node also restarts u where only a peer sent (the daemon does not return the
  local selection). The daemon must run plain ``error_feedback = "residual"`` (its default), not
  its own ``momentum``. Weight decay stays in the optimizer, outside the momentum. u is keyed by
  parameter (DDP's bucket rebuild after the first iteration may reorder a bucket) and is in
  ``state_dict()``. Without the option, a daemon that goes from dense steps (the ring, a
  schedule's warm-up) to sparse ones hands SGD's momentum those bursts too: on the digits jobs
  100 dense steps and then top-k 0.5 % took 1.13x the steps of top-k from the start, the accuracy
  15-18 pp down after the switch (docs/controllers.md, "What a dense step is worth, in steps").
  The hook counts such switches (``summary()["dense_to_sparse_switches"]``) and, after 20 or
  more dense steps with momentum outside it, says so once in the log.
* **State.** ``hook.state_dict()`` / ``hook.load_state_dict()`` carry the step counter, the
  registered layout, the counters and the momentum-correction velocity across a restart (see
  :meth:`SparsecarHook.state_dict`); the error-feedback residual lives in the daemon and is saved
  with ``sparsecarctl checkpoint``.

Rules: one sparsecar client per DDP rank (the daemon's --local-clients equals the local ranks),
the daemon averages over all trainers of the job, so the job's trainers must be exactly the DDP
ranks. Gradients must be float32, float16 or bfloat16 (otherwise the hook stays on plain
all-reduce and warns); the daemon compresses float32, half buckets are cast on their device.
Every rank must register the same tensors in the same order: they must run the same model.
"""

import collections
import contextlib
import logging
import os
import queue
import sys
import threading
import time
import warnings
import weakref

import torch
import torch.distributed as dist

import sparsecar

log = logging.getLogger("sparsecar.torch")

__all__ = ["register", "SparsecarHook", "node_rank", "nnodes"]

STATE_VERSION = 1  # of state_dict(); load_state_dict() refuses others


def _env_int(names):
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not an integer") from None
    return None


def node_rank():
    """This node's rank among the job's nodes (one sparsecard each): $SPARSECAR_NODE_RANK, else
    $NODE_RANK, else None. Never torchrun's per-process RANK."""
    return _env_int(("SPARSECAR_NODE_RANK", "NODE_RANK"))


def nnodes():
    """The job's node count: $SPARSECAR_NNODES, else $NNODES, else None. Never WORLD_SIZE (that is
    the number of processes)."""
    return _env_int(("SPARSECAR_NNODES", "NNODES"))


class _Slice:
    """One sparsecar tensor of a bucket: elements [offset, offset + numel) of its buffer. On the
    device path `stage` is its float32 GPU buffer registered with the daemon (CUDA IPC) and
    `ready` / `done` its interprocess events."""
    __slots__ = ("name", "offset", "numel", "shape", "tensor", "stage", "ready", "done")

    def __init__(self, name, offset, numel, shape):
        self.name, self.offset, self.numel, self.shape, self.tensor = name, offset, numel, shape, None
        self.stage = self.ready = self.done = None


class SparsecarHook:
    """The hook's state (one per DDP model). Create it with register()."""

    def __init__(self, socket=None, *, optimizer=None, lr=None, dense_iterations=2,
                 on_error="fallback", timeout=60.0, connect_timeout=10.0, process_group=None,
                 prefix=None, tensors="buckets", param_names=None, device=None, announce="rank0",
                 device_path="auto", agreement="auto", momentum_correction=False, static_graph=None):
        if on_error not in ("fallback", "raise"):
            raise ValueError('on_error must be "fallback" or "raise"')
        if tensors not in ("parameters", "buckets"):
            raise ValueError('tensors must be "parameters" or "buckets"')
        if announce not in ("rank0", "all", None):
            raise ValueError('announce must be "rank0", "all" or None')
        if device_path not in ("auto", "off", "require"):
            raise ValueError('device_path must be "auto", "off" or "require"')
        if agreement not in ("auto", "device", "gloo"):
            raise ValueError('agreement must be "auto", "device" or "gloo"')
        # Validated before anything else, so a bad optimizer leaves it and the daemon untouched.
        self.momentum = _sgd_momentum(optimizer) if momentum_correction else None
        self._velocity = {}          # bucket index -> _Velocity (momentum correction)
        self._sparse_before = set()  # names of the slices whose last daemon step was sparse
        self._param_velocity = {}    # id(parameter) -> its slice of a bucket's u
        self._restored_velocity = {}  # parameter name -> u from load_state_dict, until first used
        self.device_path = device_path
        self.agreement = agreement   # resolved by _connect(): "device" or "gloo"
        self._agree_group = None     # the gloo side group when agreement resolves to "gloo"
        self.socket = socket or os.environ.get("SPARSECAR_SOCKET", sparsecar.DEFAULT_SOCKET)
        self.optimizer = optimizer
        self.lr = lr
        self.dense_iterations = max(2, int(dense_iterations))
        self.on_error = on_error
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.process_group = process_group
        self.tensors = tensors
        self.prefix = prefix if prefix is not None else ("ddp.bucket" if tensors == "buckets" else "")
        self.announce = announce
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.node_rank, self.nnodes = node_rank(), nnodes()  # read once: a bad value fails here
        self.iteration = 0           # the step number sent to the daemon; counts every iteration
        self.mode = "warmup"         # warmup -> sparse -> (fallback); or warmup -> fallback
        self.failure = None          # the first error, as text
        self.stats = collections.Counter()
        self._names = dict(param_names or {})  # id(parameter) -> name in the model
        self._client = None
        self._slices = {}            # bucket index -> [_Slice], registered
        self._layout = {}            # bucket index -> layout key, this iteration
        self._prev_layout = None
        self._restored_layout = None  # from load_state_dict: counts as "stable" once seen again
        self._dense_here = 0         # dense iterations in this process (DDP rebuilds after the 1st)
        self._rebuilt = False        # two of this process's dense iterations had different buckets
        # Whether DDP's model is static_graph=True (a callable, read at each dense iteration's end:
        # DDP's _set_static_graph() may come after register()); None: not a static graph.
        self._static_graph = static_graph
        self._in_iteration = False
        self._step_failed = False    # a sparsecar step failed; dense from the next iteration on
        self._warned = False
        self._warned_host_staging = False
        self._dense_run = 0          # the daemon's dense steps since its last sparse one (leases too)
        self._warned_switch = False  # the dense -> sparse switch without momentum_correction, once
        self._jobs = queue.Queue()
        self._worker = None
        self._closed = False
        self._hooked = False         # the hook ran at least once (load_state_dict is too late then)
        self._per_tensor = {}        # name -> [steps, elements, nnz, bytes_sent, dense_bytes]
        self._t_iteration = None     # monotonic time of this iteration's first sparse bucket
        self._t_prev_iteration = None
        # Leases (dense_collective=trainer): iterations still to all-reduce without the daemon, as
        # every rank agreed (set by the completion thread before the granting iteration's last
        # future; read by the hook at the next iteration's first bucket), whether this iteration is
        # one, and the granting step's dense bytes (what each leased iteration's all-reduce sends).
        self._lease_left = 0
        self._leased = False
        self._lease_bytes = 0
        # The trainer's compute per sparse iteration (_time_compute): step -> {"first", "last",
        # "done", "next"}: its first and last buckets, its averages back (set by the completion
        # thread) and the next iteration's first bucket; host times, or CUDA events on the device path.
        self._compute_marks = {}
        self._computes = collections.deque(maxlen=100)  # the last iterations' compute (s)
        self._held_compute = False  # the last compute sample was a lone outlier, held back
        # The dense (warm-up) iterations' timing: _start_timing() of them goes
        # to the daemon (_report_dense_timing).
        self._dense_t = None         # _DenseClock of this dense iteration
        self._dense_pending = []     # (_DenseClock, the next iteration's first mark): not yet read
        self._dense_timings = []     # (period_s, exchange_wait_s) of each whole dense iteration read
        self._dense_timing_sent = False
        self.path = None             # "device" (CUDA IPC) or "host" (shm staging) once registered
        self._sync_stream = None     # device path: where the daemon's done events are waited on

    # ---- public ------------------------------------------------------------------------------
    def report_metric(self, name, value, step=None):
        """Reports a scalar (e.g. "loss") for the current iteration to the daemon. A no-op while
        the hook is not on sparsecar (warm-up, fallback); never raises on a daemon error."""
        if self.mode != "sparse" or self._client is None:
            return
        try:
            self._client.report_metric(name, float(value), self.iteration if step is None else step)
        except sparsecar.Error as e:
            log.warning("sparsecar: report_metric(%s) failed: %s", name, e)

    @property
    def dense_timing(self):
        """(period_s, exchange_wait_s) of the dense iterations as the daemon weighs them, or None:
        _start_timing() of every whole one. On a GPU the marks are CUDA events: reading them first
        waits until the GPU has passed them."""
        for clock, next_first in self._dense_pending:
            self._dense_timings.append(clock.timing(next_first))
        self._dense_pending = []
        return _start_timing(self._dense_timings)

    @property
    def active(self):
        """True while buckets go through sparsecar."""
        return self.mode == "sparse"

    @property
    def tensor_names(self):
        """The names registered with the daemon, in registration order (empty before)."""
        return [sl.name for index in sorted(self._slices) for sl in self._slices[index]]

    def summary(self, per_tensor=False):
        """What the hook did so far, as a dict:

        mode, path ("device": GPU buckets handed over by CUDA IPC and compressed on the GPU;
        "host": staged through shared memory; None before registering), agreement ("gloo": the
        side group, "device": DDP's group), iterations (every DDP iteration hooked, restored ones included), sparse_iterations,
        dense_buckets (warm-up and fallback), sparse_buckets (through the daemon),
        trainer_reduced_buckets (of those, dense steps the daemon handed back for this process
        group's own all-reduce: dense_collective=trainer), leases / leased_iterations (leases taken,
        and the iterations all-reduced under them without the daemon: see "Leases"), tensors
        (registered), bytes_sent / dense_bytes (the daemon's report for this node: wire bytes vs.
        what a dense ring all-reduce would have sent; a leased iteration counts what the
        trainer-reduced step that granted it counted, the ring's bytes), ratio (dense_bytes /
        bytes_sent; None before any sparse step), density (selected / elements), mean_step_s
        (wall time from one sparse iteration's first bucket to the next one's: forward + backward
        + optimizer; not across a lease), mean_exchange_s (first bucket handed to the
        daemon to the iteration's averages back), compute_s (the median over the last 100
        sparse iterations of their time outside the exchange, each reported to the daemon as
        "hook_compute_time": host times on CPU buckets, CUDA events on the device path; None for
        staged GPU buckets), dense_step_s / dense_wait_s (the quickest dense
        iteration's period and the all-reduce's share of it, that period less the least time a
        dense iteration spent outside the all-reduce; reported to the daemon before the first
        sparse step), dense_steps_s / dense_waits_s (every whole dense
        iteration's period and wait, in order), momentum_correction (the SGD momentum the hook
        applies, None without it), dense_to_sparse_switches (the daemon's switches from dense steps,
        leased ones included, to sparse ones). per_tensor=True adds "per_tensor": name ->
        {steps, elements, nnz, density, bytes_sent, dense_bytes}. On a node with several ranks
        each rank sees the whole node's bytes."""
        st = self.stats
        # A leased iteration sends what the trainer-reduced step that granted it did (the ring's bytes).
        sent = st["sparsecar_bytes"] + st["leased_dense_bytes"]
        dense = st["sparsecar_dense_equivalent_bytes"] + st["leased_dense_bytes"]
        out = {
            "mode": self.mode,
            "path": self.path,
            "agreement": self.agreement,
            "iterations": self.iteration,
            "sparse_iterations": st["sparse_iterations"],
            "dense_buckets": st["dense_buckets"],
            "sparse_buckets": st["sparse_buckets"],
            "trainer_reduced_buckets": st["trainer_reduced_buckets"],
            "leases": st["leases"],
            "leased_iterations": st["leased_iterations"],
            "failed_steps": st["failed_steps"],
            "tensors": sum(len(v) for v in self._slices.values()),
            "bytes_sent": sent,
            "dense_bytes": dense,
            "ratio": (dense / sent) if sent else None,
            "density": (st["sparsecar_nnz"] / st["sparsecar_elements"]) if st["sparsecar_elements"] else None,
            "mean_step_s": (st["step_ns"] / st["step_samples"] / 1e9) if st["step_samples"] else None,
            "mean_exchange_s": (st["exchange_ns"] / st["sparse_iterations"] / 1e9) if st["sparse_iterations"] else None,
            "compute_s": self._median_compute(),
            "dense_step_s": self.dense_timing[0] if self.dense_timing else None,
            "dense_wait_s": self.dense_timing[1] if self.dense_timing else None,
            "dense_steps_s": [t[0] for t in self._dense_timings],
            "dense_waits_s": [t[1] for t in self._dense_timings],
            "failure": self.failure,
            "momentum_correction": self.momentum,
            "dense_to_sparse_switches": st["dense_to_sparse_switches"],
        }
        if per_tensor:
            out["per_tensor"] = {
                name: {"steps": v[0], "elements": v[1], "nnz": v[2], "density": v[2] / v[1] if v[1] else None,
                       "bytes_sent": v[3], "dense_bytes": v[4]}
                for name, v in self._per_tensor.items()}
        return out

    def summary_line(self):
        """summary() as one line of text."""
        s = self.summary()
        parts = [f"sparsecar DDP hook: {s['mode']}, {s['iterations']} iterations "
                 f"({s['sparse_iterations']} through sparsecar)"]
        if s["bytes_sent"]:
            parts.append(f"{s['bytes_sent']} B sent vs {s['dense_bytes']} B dense (ratio {s['ratio']:.1f}x, "
                         f"density {s['density']:.4g})")
        if s["mean_step_s"] is not None:
            parts.append(f"mean step {s['mean_step_s'] * 1e3:.1f} ms")
        if s["mean_exchange_s"] is not None:
            parts.append(f"mean exchange {s['mean_exchange_s'] * 1e3:.1f} ms")
        if s["failure"]:
            parts.append(f"failure: {s['failure']}")
        return ", ".join(parts)

    def state_dict(self):
        """The hook's own state as plain Python values (torch.save-able): the step counter (the
        step numbers the daemon sees, which its schedule controller and warm-up ramp follow), the
        registered layout (bucket -> parameter names, sizes, shapes: the registration order the
        daemon's residual checkpoint is keyed by), and the counters behind summary().

        Not in it: the error-feedback residual. It lives in the daemon (per node, summed over the
        node's ranks); save it with ``sparsecarctl checkpoint PATH`` on every node at the same
        step and, after the restart, ``sparsecarctl restore PATH`` once the trainers registered
        and before the first sparse step (format and rules: daemon/pipeline/CHECKPOINT.md).
        Without that the residual restarts at zero: nothing breaks, the unsent remainder is lost.
        Neither is the mode: a restored hook registers its tensors with the daemon again, after
        the dense iterations DDP needs to rebuild its buckets in the new process.

        With momentum_correction, "momentum" holds m and this trainer's velocity u per parameter
        name (float32 CPU tensors: torch.save-able, not JSON), so a restore keeps it whatever
        buckets DDP builds in the new process; every rank saves and restores its own. It also
        names the tensors whose last daemon step was sparse ("sparse_before": their first dense
        step restarts u)."""
        layout = None
        if self._slices:
            layout = [[index, [[sl.name, sl.numel, list(sl.shape) if sl.shape is not None else None]
                               for sl in self._slices[index]]]
                      for index in sorted(self._slices)]
        return {
            "version": STATE_VERSION,
            "iteration": self.iteration,
            "tensors": self.tensors,
            "layout": layout,
            "mode": self.mode,
            "failure": self.failure,
            "stats": dict(self.stats),
            "per_tensor": {k: list(v) for k, v in self._per_tensor.items()},
            "momentum": self._momentum_state(),
        }

    def _momentum_state(self):
        if self.momentum is None:
            return None
        velocity = {name: u.detach().to("cpu", copy=True) for name, u in self._restored_velocity.items()}
        for pid, u in self._param_velocity.items():
            name = self._names.get(pid)
            if name is not None:
                velocity[name] = u.detach().to("cpu", copy=True)
        return {"m": self.momentum, "velocity": velocity, "sparse_before": sorted(self._sparse_before)}

    def load_state_dict(self, state):
        """Restores state_dict()'s values; call it after register() and before the first
        backward(). The step counter continues from the saved one; if DDP's rebuilt buckets hold
        the same parameters as the saved layout, the hook switches to sparsecar after the 2
        iterations DDP needs to rebuild them (not dense_iterations again). The mode and the
        failure are not restored: a hook that had fallen back tries sparsecar again."""
        if self._hooked:
            raise RuntimeError("sparsecar DDP hook: load_state_dict() must come before the first backward()")
        version = state.get("version")
        if version != STATE_VERSION:
            raise ValueError(f"sparsecar DDP hook state version {version!r}; this hook reads {STATE_VERSION}")
        if state.get("tensors", self.tensors) != self.tensors:
            raise ValueError(f"the state was saved with tensors={state.get('tensors')!r}, this hook uses "
                             f"tensors={self.tensors!r}")
        self.iteration = int(state["iteration"])
        self.stats = collections.Counter({k: int(v) for k, v in state.get("stats", {}).items()})
        self._per_tensor = {k: [int(x) for x in v] for k, v in state.get("per_tensor", {}).items()}
        momentum = state.get("momentum")
        if momentum is not None:
            if self.momentum is None:
                raise ValueError("the state was saved with momentum_correction=True (it holds the SGD momentum's "
                                 "velocity); register this hook with momentum_correction=True too")
            self._restored_velocity = {name: u.detach().to(torch.float32).reshape(-1)
                                       for name, u in momentum["velocity"].items()}
            self._sparse_before = {str(name) for name in momentum.get("sparse_before", [])}
        layout = state.get("layout")
        if layout is not None:
            self._restored_layout = {int(index): self._layout_key_from_saved(entries)
                                     for index, entries in layout}

    def _layout_key_from_saved(self, entries):
        if self.tensors == "buckets":
            return entries[0][1]
        return tuple((name, numel, tuple(shape) if shape is not None else None)
                     for name, numel, shape in entries)

    def close(self):
        """Stops the completion thread and closes the session (the hook then uses all-reduce)."""
        if self._closed:
            return
        self._closed = True
        if self.mode == "sparse":
            self.mode = "fallback"
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(timeout=self.timeout + 5)
        if self._client is not None:
            self._client.close()
            self._client = None
        for slices in self._slices.values():  # the session ends once no slot view is left
            for sl in slices:
                sl.tensor = None

    # ---- setup -------------------------------------------------------------------------------
    def _connect(self):
        """Connects (all ranks agree whether everyone could). Called by register()."""
        self._setup_agreement()
        ok = True
        try:
            self._client = sparsecar.Client(self.socket, timeout=self.connect_timeout)
        except sparsecar.Error as e:
            ok = False
            self._note_failure(f"cannot connect to the sparsecar daemon at {self.socket}: {e}")
        if not self._all_ranks_ok(ok, self.device):
            if ok:
                self._note_failure("another rank could not connect to its sparsecar daemon")
            self._give_up()
        # Only once register() cannot fail any more (on_error="raise" raised above): from here on
        # the hook applies the momentum on every path, the fallback's all-reduce included.
        if self.momentum is not None:
            _move_momentum_out_of(self.optimizer, self.momentum)

    def _setup_agreement(self):
        """Resolves `agreement` (see "Agreement on any backend" in the module doc). Collective
        when it creates the gloo side group: every rank runs register() in the same order."""
        want = self.agreement
        if want == "auto":
            backend = str(dist.get_backend(self.process_group)).lower()
            if self.process_group is not None or "gloo" in backend or not dist.is_gloo_available():
                want = "device"  # gloo already takes CPU tensors; a subgroup cannot make one here
            else:
                want = "gloo"
        if want == "gloo":
            if self.process_group is not None:
                ranks = dist.get_process_group_ranks(self.process_group)
                self._agree_group = dist.new_group(ranks=ranks, backend="gloo")
            else:
                self._agree_group = dist.new_group(backend="gloo")
        self.agreement = want

    def _all_ranks_ok(self, ok, device):
        """Whether every rank says ok (see _agree)."""
        return self._agree(ok, 0, device)[0]

    def _agree(self, ok, lease, device):
        """MIN all-reduce of (ok, lease): whether every rank is ok, and the least lease any rank
        was granted (0 unless all are ok). On the CPU through the gloo side group, or on `device`
        (the device DDP's gradients live on, which the group's backend serves: NCCL refuses CPU
        tensors, gloo takes both)."""
        values = [1 if ok else 0, int(lease) if ok else 0]
        if self._agree_group is not None:
            flag = torch.tensor(values, dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._agree_group)
        else:
            with _on_device(device):
                flag = torch.tensor(values, dtype=torch.int32, device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.process_group)
        all_ok, least = flag.tolist()
        return bool(all_ok), int(least) if all_ok else 0

    def _current_lr(self):
        if self.optimizer is not None:
            return float(self.optimizer.param_groups[0]["lr"])
        if callable(self.lr):
            return float(self.lr())
        return float(self.lr or 0.0)

    def _layout_key(self, bucket, buf):
        """What must stay the same between iterations for the registration to hold: the bucket's
        size, and in parameter mode its parameters (name, size, shape) in buffer order. None when
        the bucket is not float32, float16 or bfloat16 (half buckets are cast to float32 on their
        device: the daemon compresses float32)."""
        if buf.dtype not in _BUCKET_DTYPES:
            return None
        if self.tensors == "buckets":
            return buf.numel()
        key = []
        for j, p in enumerate(bucket.parameters()):
            key.append((self._param_name(bucket.index(), j, p), p.numel(), tuple(p.shape)))
        if sum(n for _, n, _ in key) != buf.numel():
            # Not laid out as the parameters back to back (cannot happen with dense gradients):
            # the bucket goes as one flat tensor.
            return buf.numel()
        return tuple(key)

    def _param_name(self, index, j, p):
        return self._names.get(id(p)) or f"ddp.bucket.{index}.{j}"  # unnamed: cannot happen via register()

    def _layout_mismatch(self, index, bucket, buf):
        """Why this bucket no longer matches its registration (None when it does)."""
        layout = self._layout.get(index)
        if layout is None:
            return "was not registered"
        if not isinstance(layout, tuple):
            return None if layout == buf.numel() else f"has {buf.numel()} elements, registered {layout}"
        names = tuple(self._param_name(index, j, p) for j, p in enumerate(bucket.parameters()))
        if names != tuple(name for name, _, _ in layout):
            return f"holds parameters {list(names)}, registered {[name for name, _, _ in layout]}"
        return None

    def _slices_of(self, index, key):
        if not isinstance(key, tuple):
            name = f"{self.prefix}.{index}" if self.prefix else f"ddp.bucket.{index}"
            return [_Slice(name, 0, key, None)]
        slices, offset = [], 0
        for name, numel, shape in key:
            if numel > 0:  # an empty parameter has nothing to send
                full = f"{self.prefix}.{name}" if self.prefix else name
                reg_shape = shape if 1 <= len(shape) <= sparsecar.MAX_DIMS else None
                slices.append(_Slice(full, offset, numel, reg_shape))
            offset += numel
        return slices

    def _register_buckets(self, device):
        ok = True
        try:
            use_device = self._device_path_wanted(device)
            for index in sorted(self._layout):
                slices = self._slices_of(index, self._layout[index])
                for sl in slices:
                    if use_device:
                        use_device = self._register_on_device(sl, device)
                    if not use_device:
                        sl.tensor = self._client.register(sl.name, tuple(sl.shape) if sl.shape else sl.numel)
                self._slices[index] = slices
            self.path = "device" if use_device else "host"
            if use_device:
                self._sync_stream = torch.cuda.Stream(device=device)
        except (sparsecar.Error, RuntimeError, ValueError) as e:
            ok = False
            self._note_failure(f"registering the DDP buckets with sparsecar failed: {e}")
        if not self._all_ranks_ok(ok, device):
            if ok:
                self._note_failure("another rank could not register its DDP buckets with sparsecar")
            self._give_up()
            return
        self.mode = "sparse"
        self._worker = threading.Thread(target=self._complete_loop, name="sparsecar-ddp-completion",
                                        daemon=True)
        self._worker.start()
        self._announce()

    def _device_path_wanted(self, device):
        """Whether to try registering GPU buffers (CUDA IPC) instead of host slots."""
        if self.device_path == "off" or device is None or device.type != "cuda":
            return False
        if not hasattr(self._client, "register_device"):
            return self._no_device_path("this sparsecar Python package has no device registration")
        return True

    def _no_device_path(self, why):
        if self.device_path == "require":
            raise RuntimeError(f"device_path='require' but {why}")
        log.warning("sparsecar: GPU buckets are staged through host memory: %s", why)
        if not self._warned_host_staging:
            self._warned_host_staging = True
            warnings.warn(f"sparsecar DDP hook: GPU buckets are staged through host memory: {why}",
                          RuntimeWarning, stacklevel=5)
        return False

    def _register_on_device(self, sl, device):
        """Registers slice `sl` as a device tensor: a float32 buffer on `device` that the daemon
        maps by CUDA IPC, with its ready/done interprocess events. False (after one warning) when
        the daemon refuses device tensors (no CUDA or no GPU there); other errors raise."""
        sl.stage = torch.zeros(sl.numel, dtype=torch.float32, device=device)
        sl.ready = torch.cuda.Event(interprocess=True)
        sl.done = torch.cuda.Event(interprocess=True)
        with torch.cuda.device(device):
            # An interprocess event exists once recorded: record both before taking their handles.
            sl.ready.record()
            sl.done.record()
        handles = sparsecar.device_handles(sl.stage, sl.ready, sl.done)
        try:
            sl.tensor = self._client.register_device(sl.name, sl.numel, shape=tuple(sl.shape) if sl.shape else None,
                                                     **handles)
        except sparsecar.Error as e:
            if getattr(e, "code_name", "") != "UNAVAILABLE" or self._slices:
                raise
            sl.stage = sl.ready = sl.done = None
            return self._no_device_path(f"the daemon does not take GPU tensors: {e}")
        return True

    def _announce(self):
        """One line a user sees by default (stderr), on rank 0 or every rank; also logged."""
        rank = dist.get_rank(group=self.process_group)
        world = dist.get_world_size(group=self.process_group)
        n_tensors = sum(len(v) for v in self._slices.values())
        elements = sum(sl.numel for v in self._slices.values() for sl in v)
        node, nodes = self.node_rank, self.nnodes
        where = f"node {node}" + (f" of {nodes}" if nodes is not None else "") if node is not None else "this node"
        what = "parameter tensors" if self.tensors == "parameters" else "bucket tensors"
        line = (f"sparsecar: rank {rank} of {world}: {n_tensors} {what} ({elements} elements in "
                f"{len(self._slices)} DDP buckets) go through the daemon of {where} ({self.socket}) from step "
                f"{self.iteration} on ({'GPU buffers by CUDA IPC' if self.path == 'device' else 'staged through host memory'}); "
                f"hook.summary() reports bytes and ratio")
        log.info("%s", line)
        if self.announce == "all" or (self.announce == "rank0" and rank == 0):
            print(line, file=sys.stderr, flush=True)

    # ---- errors ------------------------------------------------------------------------------
    def _note_failure(self, message):
        # Log the real cause here: a failing hook only shows up as "Unable to cast" in torch.
        log.error("sparsecar: %s", message)
        if self.failure is None:
            self.failure = message

    def _give_up(self):
        """No sparsecar for this job: plain all-reduce from now on (or raise)."""
        self.mode = "fallback"
        if self.on_error == "raise":
            raise RuntimeError(f"sparsecar DDP hook: {self.failure}")
        if not self._warned:
            self._warned = True
            warnings.warn(f"sparsecar DDP hook: falling back to plain all-reduce: {self.failure}",
                          RuntimeWarning, stacklevel=3)

    # ---- dense path --------------------------------------------------------------------------
    def _world(self):
        return dist.get_world_size(group=self.process_group)

    def _allreduce_async(self, buf, count=True):
        if count:  # the warm-up's and the fallback's (a lease counts its own)
            self.stats["dense_elements"] += buf.numel()
            self.stats["dense_buckets"] += 1
        world = self._world()
        work = dist.all_reduce(buf, group=self.process_group, async_op=True)
        clock = self._dense_t if self.mode == "warmup" else None

        def averaged(f):
            if clock is not None:
                clock.all_reduce_done(buf)
            return f.value()[0].div_(world)
        return work.get_future().then(averaged)

    def _allreduce_now(self, buf):
        self.stats["dense_elements"] += buf.numel()
        self.stats["dense_buckets"] += 1
        with _on_device(buf.device):
            dist.all_reduce(buf, group=self.process_group)
            return buf.div_(self._world())

    # ---- the hook ----------------------------------------------------------------------------
    def __call__(self, bucket):
        try:
            return self._hook(bucket)
        except Exception as e:  # noqa: BLE001 - torch would hide it behind "Unable to cast"
            log.exception("sparsecar DDP hook failed at bucket %d: %s", bucket.index(), e)
            raise

    def _hook(self, bucket):
        self._hooked = True
        index, buf, last = bucket.index(), bucket.buffer(), bucket.is_last()
        step = self.iteration
        if not self._in_iteration:
            # Mode changes only here, between iterations: backward() waited for every future of
            # the previous iteration, so every failure of it is known, and every rank that saw
            # the same failures switches at the same bucket.
            self._in_iteration = True
            if self._dense_t is not None or self.mode == "warmup":
                first = _mark(buf)
                if self._dense_t is not None and self._dense_t.complete:
                    self._dense_pending.append((self._dense_t, first))
                self._dense_t = _DenseClock(buf, first) if self.mode == "warmup" else None
            if self.mode == "sparse" and self._step_failed:
                self.mode = "fallback"
            self._leased = self.mode == "sparse" and self._lease_left > 0
            if self._leased:
                self._lease_left -= 1
                self.stats["leased_iterations"] += 1
                self._dense_run += 1
                self.stats["leased_dense_bytes"] += self._lease_bytes
                self._t_prev_iteration = None  # mean_step_s: the daemon's iterations, each after one
                self._mark_next(step, buf)
            elif self.mode == "sparse":
                now = time.monotonic()
                if self._t_prev_iteration is not None:
                    self.stats["step_ns"] += int((now - self._t_prev_iteration) * 1e9)
                    self.stats["step_samples"] += 1
                self._t_prev_iteration = self._t_iteration = now
                self._time_compute(step, buf, now)
        if last:
            self._in_iteration = False
            if self.mode == "sparse" and step in self._compute_marks:
                self._compute_marks[step]["last"] = _mark(buf)
            if self._dense_t is not None:
                self._dense_t.last_bucket = _mark(buf)
        if self.momentum is not None:
            self._apply_momentum(bucket, buf)
        if self.mode == "warmup":
            self._layout[index] = self._layout_key(bucket, buf)
            fut = self._allreduce_async(buf)
            if last:
                clock = self._dense_t
                self._end_warmup_iteration(buf.device)
                if clock is not None:
                    clock.hook_end = _mark(buf)
            return fut
        if self._leased:
            # A step of the daemons' lease: DDP's own all-reduce, no round trip (see "Leases").
            self.stats["leased_buckets"] += 1
            fut = self._allreduce_async(buf, count=False)
            if last:
                self.iteration += 1
            return fut
        if self.mode == "sparse":
            if not self._dense_timing_sent:
                self._report_dense_timing(step)
            fut = _future_for(buf)
            slices = self._slices.get(index)
            mismatch = self._layout_mismatch(index, bucket, buf)
            if mismatch:
                # Cannot happen after a stable layout unless DDP rebuilt its buckets again.
                self._fail_step(f"bucket {index} {mismatch}")
                self._jobs.put(("failed", index, buf, fut, step, last))
            else:
                try:
                    flat = buf.view(-1)
                    lr = self._current_lr()
                    if self.path == "device":
                        # Into the registered float32 buffers (cast on the GPU for half buckets);
                        # the daemon's stream waits for `ready`, the host does not wait.
                        stream = torch.cuda.current_stream(buf.device)
                        for sl in slices:
                            sl.stage.copy_(flat[sl.offset:sl.offset + sl.numel])
                            sl.ready.record(stream)
                            self._client.submit(sl.tensor, step, lr=lr, trainer_reduces=True, takes_lease=True)
                    else:
                        for sl in slices:
                            sparsecar.copy_into(sl.tensor.array(), flat[sl.offset:sl.offset + sl.numel])
                            self._client.submit(sl.tensor, step, lr=lr, trainer_reduces=True, takes_lease=True)
                    self._jobs.put(("sparse", index, buf, fut, step, last))
                except sparsecar.Error as e:
                    self._fail_step(f"submitting bucket {index} step {step} failed: {e}")
                    self._jobs.put(("failed", index, buf, fut, step, last))
            if last:
                self.iteration += 1
            return fut
        # fallback (or sparse after a failure): keep the collectives in one thread, in order
        if self._worker is not None:
            fut = _future_for(buf)
            self._jobs.put(("dense", index, buf, fut, step, last))
            if last:
                self.iteration += 1
            return fut
        fut = self._allreduce_async(buf)
        if last:
            self.iteration += 1
        return fut

    def _report_dense_timing(self, step):
        """Before the first step through sparsecar: the quickest dense iteration's period and the
        all-reduce's share of it (the same link the daemons use; _start_timing), as the metrics
        "dense_step_s" and "dense_wait_s". The daemon's step controller reads them before
        its first step: on a link where a dense step costs several sparse ones it ends the
        schedule's dense warm-up there (docs/controllers.md, "The warm-up before the first step").
        Before them "momentum_correction" (1 or 0): with the correction a dense step's lead
        survives a switch to sparse, and the step controller prices sparse steps x
        step_dense_worth_corrected instead of x step_dense_worth."""
        self._dense_timing_sent = True
        try:
            self._client.report_metric("momentum_correction", 1.0 if self.momentum is not None else 0.0, step)
        except sparsecar.Error as e:
            log.warning("sparsecar: reporting momentum_correction failed: %s", e)
        if self.dense_timing is None:
            return
        period, wait = self.dense_timing
        try:
            # The wait first: the daemon acts on dense_step_s with the wait it already holds.
            self._client.report_metric("dense_wait_s", float(wait), step)
            self._client.report_metric("dense_step_s", float(period), step)
        except sparsecar.Error as e:
            log.warning("sparsecar: reporting the dense iterations' timing failed: %s", e)

    def _time_compute(self, step, buf, now):
        """At a sparse iteration's first bucket: marks it, and reports the compute of earlier
        iterations whose marks are all passed, as the metric "hook_compute_time" (s): (its last
        bucket - its first) + (the next one's first bucket - its averages back), i.e. backward
        between its buckets, then the optimizer, the forward and backward up to the next
        iteration's first bucket; the exchange left out. The daemon takes it where the trainer
        reports no "compute_time" of its own (its step controller tells a loaded host from a
        slower link by it: docs/controllers.md, "Step v10"). CPU buckets: read at once. The device
        path: CUDA events, read an iteration later once the GPU has passed them (queried, never
        waited on). Staged CUDA buckets: not timed. Not after a failed or fallback iteration (no
        averages back)."""
        marks = self._compute_marks
        first = self._mark_next(step, buf, now)
        if first is None:
            return
        marks[step] = {"first": first}
        for s in sorted(marks):
            m = marks[s]
            if s < step and "next" not in m:
                del marks[s]  # never completed (a failed iteration)
                continue
            if "next" not in m:
                continue
            if buf.is_cuda and not all(m[k].query() for k in ("first", "last", "done", "next")):
                if s < step - 2:
                    del marks[s]  # its events not passed in time
                continue
            c = _seconds_between(m["first"], m["last"]) + _seconds_between(m["done"], m["next"])
            del marks[s]
            if not c > 0 or self._lone_outlier(c):
                continue
            self._computes.append(c)
            try:
                self._client.report_metric("hook_compute_time", c, s)
            except sparsecar.Error as e:
                log.warning("sparsecar: reporting the trainer's compute time failed: %s", e)

    def _mark_next(self, step, buf, now=None):
        """This iteration's first bucket: the mark (None for staged CUDA buckets, which are not
        timed), also the "next" of the iteration before if its averages are back. A leased
        iteration marks only that: the iteration that granted the lease is timed up to it and
        reported at the next iteration through the daemon."""
        if buf.is_cuda and self.path != "device":
            return None
        first = _mark(buf) if buf.is_cuda else (time.monotonic() if now is None else now)
        prev = self._compute_marks.get(step - 1)
        if prev is not None and "last" in prev and "done" in prev:
            prev["next"] = first
        return first

    def _median_compute(self):
        """The upper median of the last iterations' compute (s), or None before any."""
        return sorted(self._computes)[len(self._computes) // 2] if self._computes else None

    def _lone_outlier(self, c):
        """A compute sample over _OUTLIER_FACTOR x the median of the last ones (once there are
        _OUTLIER_BASE) is held back, once: a training loop that evaluates or checkpoints between
        two steps shows that pause as one iteration's compute, and the daemon's smoothed compute
        would lift every plan's price after it. The next sample decides: a normal one drops it, a
        second outlier in a row is the host's new pace and is reported (counted in
        stats["compute_outliers_held"] when held)."""
        if len(self._computes) < _OUTLIER_BASE:
            return False
        if c > _OUTLIER_FACTOR * self._median_compute() and not self._held_compute:
            self._held_compute = True
            self.stats["compute_outliers_held"] += 1
            return True
        self._held_compute = False
        return False

    # ---- momentum correction ---------------------------------------------------------------------
    def _apply_momentum(self, bucket, buf):
        """u = m*u + g, and the bucket holds u from here on: every path after this (the hook's
        all-reduce, host staging, the device path's float32 buffer, the all-reduce of a failed
        iteration) sends u in place of g."""
        u = self._bucket_velocity(bucket, buf)
        flat = buf.view(-1)
        u.mul_(self.momentum).add_(flat)
        flat.copy_(u)  # a half bucket sends u rounded to its dtype; u itself stays float32

    def _bucket_velocity(self, bucket, buf):
        """The bucket's u (float32, on the bucket's device). Kept per parameter: when a bucket's
        parameters change (DDP rebuilds its buckets after the first iteration, and may reorder
        them) its u is gathered again from each parameter's previous slice, or from a restored
        state_dict(), else starts at zero."""
        index = bucket.index()
        params = list(bucket.parameters())
        key = tuple((id(p), p.numel()) for p in params)
        if sum(n for _, n in key) != buf.numel():
            key = None  # not laid out as its parameters back to back (cannot happen with dense grads)
        v = self._velocity.get(index)
        if v is not None and v.key == key and v.u.numel() == buf.numel() and v.u.device == buf.device:
            return v.u
        u = torch.zeros(buf.numel(), dtype=torch.float32, device=buf.device)
        if key is not None:
            offset = 0
            for p in params:
                n = p.numel()
                old = self._param_velocity.get(id(p))
                if old is None:
                    old = self._restored_velocity.pop(self._names.get(id(p)), None)
                if old is not None and old.numel() == n:
                    u[offset:offset + n].copy_(old.reshape(-1))
                self._param_velocity[id(p)] = u[offset:offset + n]
                offset += n
        elif v is not None and v.u.numel() == buf.numel():
            u.copy_(v.u)
        self._velocity[index] = _Velocity(key, u)
        return u

    def _note_plan(self, dense):
        """Counts the daemon's switches from dense steps (the ring, the trainers' all-reduce, a
        schedule's warm-up) to sparse ones (summary()'s dense_to_sparse_switches). After at least
        _FORFEIT_STEPS dense steps, without momentum_correction and with an optimizer that may
        hold momentum, it says once in the log what such a switch has cost: error feedback's
        held-back coordinates go out in bursts that SGD's momentum applies ~1/(1-m) times, and on
        the digits jobs 100 dense steps then top-k 0.5 % took 1.13x the steps of top-k from the
        start (docs/controllers.md, "What a dense step is worth, in steps")."""
        if dense:
            self._dense_run += 1
            return
        run, self._dense_run = self._dense_run, 0
        if run == 0:
            return
        self.stats["dense_to_sparse_switches"] += 1
        if self.momentum is not None or self._warned_switch or run < _FORFEIT_STEPS:
            return
        groups = getattr(self.optimizer, "param_groups", None)
        if groups is not None and not any(g.get("momentum", 0) for g in groups):
            return  # no (SGD) momentum outside the hook: nothing to amplify the bursts
        self._warned_switch = True
        log.warning("sparsecar: the daemon went from %d dense steps to sparse ones while the optimizer's "
                    "momentum runs outside the hook; error feedback's bursts then get the momentum's gain, "
                    "and such switches have cost the dense steps' progress (register with "
                    "momentum_correction=True to move the momentum into the hook; said once)", run)

    def _mask_velocity(self, index, sl, info, average):
        """DGC's momentum factor masking after a sparse step: u = 0 where the returned average
        (float32: the daemon's slot or device buffer) is nonzero. A dense step masks nothing,
        except the first after sparse steps of the slice, which masks everything (below).

        Sparse or dense is told per slice by the daemon's report, not by the hook's mode: in mode
        "sparse" the daemon still runs dense plans (the schedule controller's warm-up, the
        bandwidth controller choosing the ring, compression off), and reports nnz = numel for
        them; a sparse plan reports what it selected. A selection of every coordinate sent the
        whole residual too, so it is a dense step as well: averaged u is the update, as in SGD
        with momentum. With several nodes the average is nonzero on the union of the nodes'
        selections (the daemon does not return this node's own), so u also restarts where only
        a peer sent; this node's residual still holds its part there."""
        if self.momentum is None:
            return
        u = self._velocity[index].u[sl.offset:sl.offset + sl.numel]
        if info.nnz >= sl.numel:
            if sl.name in self._sparse_before:
                # The first dense step after sparse ones sent the daemon's residual too: every
                # coordinate went out with the velocity it had held back, so u restarts
                # everywhere, as where a sparse step sent (docs/controllers.md, "A sparse ->
                # dense switch"); the dense steps after it are SGD with momentum again.
                self._sparse_before.discard(sl.name)
                u.zero_()
            return
        self._sparse_before.add(sl.name)
        went_out = average.reshape(-1) != 0
        if went_out.device != u.device:
            went_out = went_out.to(u.device)  # host staging of a GPU bucket
        u.masked_fill_(went_out, 0)

    def _end_warmup_iteration(self, device):
        self.iteration += 1
        self._dense_here += 1
        layout, self._layout = self._layout, {}
        same_as_prev = _same_buckets(layout, self._prev_layout)
        if self._prev_layout is not None and not same_as_prev:
            self._rebuilt = True
        stable = same_as_prev or _same_buckets(layout, self._restored_layout)
        self._prev_layout = layout
        # DDP rebuilds its buckets once, in this process's second iteration's forward (with
        # static_graph, torch 1.13: the third's), unless find_unused_parameters is set without
        # static_graph. The buckets are final once a change was seen (the rebuild is done), or
        # once they held through the iteration of the rebuild (a rebuild that kept them, or none).
        # Never before the second: the first iteration's buckets come before any rebuild. A restored
        # hook is past dense_iterations already (its step counter is).
        rebuild_in = 3 if self._static_graph is not None and self._static_graph() else 2
        final = self._rebuilt or (stable and self._dense_here >= rebuild_in)
        if self._dense_here < 2 or self.iteration < self.dense_iterations or not final:
            return
        self._layout = layout
        if any(key is None for key in layout.values()):
            self._note_failure("DDP buckets are not float32, float16 or bfloat16; sparsecar handles those only")
            self._give_up()
            return
        if self._client is None:
            self._give_up()
            return
        self._register_buckets(device)

    def _fail_step(self, message):
        """A sparsecar step failed: this bucket goes dense; later buckets of this iteration still
        try sparsecar (other ranks see the same failures); from the next iteration on, dense."""
        self._note_failure(message)
        self._step_failed = True
        self.stats["failed_steps"] += 1
        if self.on_error == "raise":
            return
        if not self._warned:
            self._warned = True
            warnings.warn(f"sparsecar DDP hook: falling back to plain all-reduce: {message}",
                          RuntimeWarning, stacklevel=4)

    # ---- completion thread -------------------------------------------------------------------
    def _complete_loop(self):
        """Completes the futures in bucket order. Sparse iterations are completed as a whole,
        after every rank agreed that every rank got every bucket (see "Fallback, agreed")."""
        pending = []  # this iteration's sparse / failed buckets: (kind, index, buf, fut, step, infos)
        while True:
            job = self._jobs.get()
            if job is None:
                for _, _, _, fut, _, _ in pending:
                    if not fut.done():
                        fut.set_exception(RuntimeError("sparsecar DDP hook: closed mid-iteration"))
                return
            kind, index, buf, fut, step, last = job
            try:
                if kind == "dense":
                    # fallback mode: plain all-reduce, in order, on this thread
                    if self.on_error == "raise" and self.failure is not None:
                        fut.set_exception(RuntimeError(f"sparsecar DDP hook: {self.failure}"))
                    else:
                        fut.set_result(self._allreduce_now(buf))
                    continue
                infos = None
                if kind == "sparse":
                    infos = []
                    for sl in self._slices[index]:
                        try:
                            infos.append(self._client.wait(sl.tensor, step, timeout=self.timeout))
                        except sparsecar.Error as e:
                            self._fail_step(f"tensor '{sl.name}' (bucket {index}) step {step} failed: {e}")
                            infos = None
                            break
                pending.append((kind, index, buf, fut, step, infos))
                if last:
                    self._finish_iteration(pending)
                    pending = []
            except Exception as e:  # noqa: BLE001 - must never leave a future unset
                log.exception("sparsecar DDP hook: completing bucket %d step %d failed", index, step)
                for _, _, _, f, _, _ in pending + [(kind, index, buf, fut, step, None)]:
                    if not f.done():
                        f.set_exception(RuntimeError(f"sparsecar DDP hook: {e}"))
                pending = []

    def _copy_out_on_device(self, sl, flat, device, index, info):
        """The daemon's average into the bucket, on the sync stream, after the daemon's done
        event (cast back for half buckets), and u masked on the same stream (the future records
        its event there after this); the host does not wait."""
        stream = self._sync_stream
        with torch.cuda.device(device), torch.cuda.stream(stream):
            stream.wait_event(sl.done)
            flat[sl.offset:sl.offset + sl.numel].copy_(sl.stage)
            self._mask_velocity(index, sl, info, sl.stage)

    def _reduce_shares(self, index, buf, infos):
        """dense_collective=trainer: the daemon handed these slices back as this rank's share of
        its node's part (StepInfo.trainer_reduces, alike on every rank for a step): all-reduce
        them over DDP's process group and divide by its size, as DDP's own dense step. Runs
        on every rank in the same bucket order (this thread, after _all_ranks_ok); one collective
        per bucket when every slice of it is a share. The device path: on the sync stream, after
        the copies into the bucket."""
        shared = [sl for sl, info in zip(self._slices[index], infos) if info.trainer_reduces]
        if not shared:
            return
        flat = buf.view(-1)
        parts = [flat] if len(shared) == len(infos) else [flat[sl.offset:sl.offset + sl.numel] for sl in shared]
        world = self._world()
        stream = self._sync_stream if self.path == "device" else None
        with _on_device(buf.device), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            for part in parts:
                dist.all_reduce(part, group=self.process_group)
                part.div_(world)
        self.stats["trainer_reduced_buckets"] += 1

    def _mark_done(self, step, buf):
        """The iteration's averages are back (before its last future: fulfilling it lets the
        trainer's backward return); on the device path an event on the sync stream, after the
        copies into the buckets."""
        marks = self._compute_marks.get(step)
        if marks is not None and "last" in marks:
            marks["done"] = _mark(buf)

    def _finish_iteration(self, pending):
        """Every rank learns whether every rank got every bucket of this iteration, then all use
        the daemon's averages or all all-reduce the original gradients."""
        mine_ok = all(infos is not None for _, _, _, _, _, infos in pending)
        lease = _lease_of(pending) if mine_ok else 0
        all_ok, lease = self._agree(mine_ok, lease, pending[-1][2].device)
        # Before any future is fulfilled: the hook reads it at the next iteration's first bucket.
        self._lease_left = lease
        if lease:
            self._lease_bytes = sum(info.dense_bytes for _, _, _, _, _, infos in pending for info in infos)
            self.stats["leases"] += 1
        if not all_ok:
            if mine_ok:
                self._fail_step("another rank's sparsecar step failed in this iteration; every rank "
                                "all-reduces it instead")
            self._step_failed = True
        if all_ok:
            # Counted before any future is fulfilled: the last set_result lets the trainer's
            # backward return, and a summary() read right after must see this iteration.
            self.stats["sparse_iterations"] += 1
            self._note_plan(all(info.nnz >= sl.numel for _, index, _, _, _, infos in pending
                                for sl, info in zip(self._slices[index], infos)))
            if self._t_iteration is not None:
                self.stats["exchange_ns"] += int((time.monotonic() - self._t_iteration) * 1e9)
        for n, (kind, index, buf, fut, step, infos) in enumerate(pending):
            if all_ok:
                flat = buf.view(-1)
                for sl, info in zip(self._slices[index], infos):
                    # u is masked here, before the future below is fulfilled: the next
                    # iteration's u = m*u + g (trainer thread) comes after DDP waited for it.
                    if self.path == "device":
                        self._copy_out_on_device(sl, flat, buf.device, index, info)
                    else:
                        sparsecar.copy_out(sl.tensor.array(), flat[sl.offset:sl.offset + sl.numel])
                        self._mask_velocity(index, sl, info, torch.from_numpy(sl.tensor.array()))
                    self.stats["sparsecar_bytes"] += info.bytes_sent
                    self.stats["sparsecar_dense_equivalent_bytes"] += info.dense_bytes
                    self.stats["sparsecar_nnz"] += info.nnz
                    self.stats["sparsecar_elements"] += sl.numel
                    t = self._per_tensor.setdefault(sl.name, [0, 0, 0, 0, 0])
                    t[0] += 1
                    t[1] += sl.numel
                    t[2] += info.nnz
                    t[3] += info.bytes_sent
                    t[4] += info.dense_bytes
                self._reduce_shares(index, buf, infos)
                self.stats["sparse_buckets"] += 1
                if self.path == "device":
                    # The future records its event on this thread's current stream: the one that
                    # waited for the daemon and copied the average into the bucket.
                    with torch.cuda.device(buf.device), torch.cuda.stream(self._sync_stream):
                        if n == len(pending) - 1:
                            self._mark_done(step, buf)
                        fut.set_result(buf)
                else:
                    if n == len(pending) - 1:
                        self._mark_done(step, buf)
                    fut.set_result(buf)
            elif self.on_error == "raise":
                fut.set_exception(RuntimeError(f"sparsecar DDP hook: bucket {index} step {step}: {self.failure}"))
            else:
                fut.set_result(self._allreduce_now(buf))  # the original gradient: copy_out never ran


def _lease_of(pending):
    """The iteration's lease (see "Leases"): the least StepInfo.lease_steps over its slices when
    every one was handed back for the trainers to reduce, else 0."""
    infos = [info for _, _, _, _, _, infos in pending if infos is not None for info in infos]
    if not infos or not all(info.trainer_reduces for info in infos):
        return 0
    return min(info.lease_steps for info in infos)


_BUCKET_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_OUTLIER_BASE = 10      # compute samples before one may be held back as a lone outlier
_OUTLIER_FACTOR = 4.0   # ... over this many times their median
_FORFEIT_STEPS = 20     # dense steps before a switch to sparse ones that _note_plan warns of


def _same_buckets(a, b):
    """Two iterations' layouts hold the same buckets: same sizes and the same parameters (in
    parameter mode), in any order within a bucket — DDP's one rebuild may reorder them."""
    if a is None or b is None or a.keys() != b.keys():
        return False
    for index, ka in a.items():
        kb = b[index]
        if isinstance(ka, tuple) and isinstance(kb, tuple):
            if sorted(ka) != sorted(kb):
                return False
        elif ka != kb:
            return False
    return True


class _Velocity:
    """Momentum correction's u of one bucket: `u` (flat float32, the bucket's layout) and `key`,
    the (id, numel) of the parameters it was laid out for (None: not per parameter)."""
    __slots__ = ("key", "u")

    def __init__(self, key, u):
        self.key, self.u = key, u


def _sgd_momentum(optimizer):
    """The momentum m that momentum_correction takes from `optimizer`; ValueError saying what is
    wrong unless it is a torch.optim.SGD whose groups all have one m > 0, dampening 0 and no
    nesterov. Changes nothing."""
    what = "momentum_correction=True"
    if optimizer is None:
        raise ValueError(f"{what} needs optimizer=, the torch.optim.SGD whose momentum the hook takes over")
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(f"{what} needs a torch.optim.SGD optimizer (its momentum moves into the hook), "
                         f"got {type(optimizer).__name__}")
    momenta = sorted({float(g.get("momentum", 0.0)) for g in optimizer.param_groups})
    if len(momenta) != 1:
        raise ValueError(f"{what} needs one momentum in every param group of the SGD optimizer, got {momenta}")
    m = momenta[0]
    if not m > 0:
        raise ValueError(f"{what} needs SGD momentum > 0 (the optimizer has momentum {m}: nothing to correct)")
    if m >= 1:
        raise ValueError(f"{what} needs SGD momentum < 1, got {m}")
    for i, g in enumerate(optimizer.param_groups):
        if float(g.get("dampening", 0.0)) != 0.0:
            raise ValueError(f"{what} needs SGD dampening 0 (param group {i} has dampening {g['dampening']})")
        if g.get("nesterov", False):
            raise ValueError(f"{what} does not do Nesterov momentum (param group {i} has nesterov=True)")
    return m


def _move_momentum_out_of(optimizer, m):
    """Sets the optimizer's momentum to 0 and drops its momentum buffers: the hook applies m."""
    for g in optimizer.param_groups:
        g["momentum"] = 0.0
    dropped = 0
    for st in optimizer.state.values():
        if st.pop("momentum_buffer", None) is not None:
            dropped += 1
    log.info("sparsecar: momentum correction: the DDP hook applies SGD momentum %g per bucket before "
             "compressing (DGC); the optimizer's momentum is set to 0%s", m,
             f" and its {dropped} momentum buffers dropped" if dropped else "")


def _start_timing(timings):
    """What the daemon's step controller weighs before its first step, from the dense iterations'
    (period_s, exchange_wait_s): the quickest period, and the exchange's share of it, that period
    less the least time any of them spent outside the exchange (its "rest": the trainer's compute
    and the hook's work around it). None without a timing.

    Each iteration is one sample on a host that other ranks share, and a stall only ever adds: a
    stall in an iteration (a 2-core box once read 24.8 ms, 22.2 of it waiting, where 11-16 ms is
    usual) would price the link at what it cost, hence the quickest period; and the rest of an
    iteration is the trainer's compute plus whatever else ran then (on that box the first
    iteration's read 5-32 ms, above the second's 4-14 ms in 17 of 18 jobs, where a sparse
    iteration's compute read 2-5 ms), which the daemon triples into a sparse step's price: the
    least rest. Both are the link's and
    the trainer's own cost without the stalls."""
    if not timings:
        return None
    period = min(t[0] for t in timings)
    rest = min(t[0] - t[1] for t in timings)
    return (period, min(max(period - rest, 0.0), period))


def _mark(buf):
    """A moment of the trainer's timeline: a host time for CPU buckets; a CUDA event on the
    bucket's device's current stream for GPU buckets (host times there are the launches)."""
    if not buf.is_cuda:
        return time.monotonic()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(buf.device))
    return event


def _seconds_between(a, b):
    """b - a for two marks of _mark(); CUDA events must both have completed."""
    if isinstance(a, float):
        return b - a
    return a.elapsed_time(b) / 1e3


class _DenseClock:
    """The moments of one dense (warm-up) iteration: its first bucket, its last bucket, its
    all-reduces done, the last bucket's hook done (after registering with the daemon, which the
    last dense iteration does). timing(next_first) gives (period, wait): the period to the next
    iteration's first bucket less the registering that ran past the all-reduce (not the
    trainer's step: it happens once), and the wait from the last bucket to the all-reduce done.

    CPU buckets: host times (time.monotonic). CUDA buckets: CUDA events on the bucket's stream,
    and in the all-reduce's callback on the stream torch hands the callback, which waits for the
    collective: an NCCL future completes when the all-reduce is enqueued, not done, so host
    times would read the wait as ~0 and the period as the host's, not the GPU's."""

    def __init__(self, buf, first):
        self.cuda = buf.is_cuda
        self.first = first
        self.last_bucket = first
        self.done = []       # one mark per all-reduce callback (they may finish out of order)
        self.hook_end = first

    @property
    def complete(self):
        return bool(self.done)

    def all_reduce_done(self, buf):
        # Inside the future's callback: on a GPU torch made the current stream wait for the collective.
        self.done.append(_mark(buf))

    def _since_first(self, mark):
        if self.cuda:
            mark.synchronize()
        return _seconds_between(self.first, mark)

    def timing(self, next_first):
        if self.cuda:
            self.first.synchronize()
        done = max(self._since_first(d) for d in self.done)
        last_bucket = self._since_first(self.last_bucket)
        registering = max(self._since_first(self.hook_end) - done, 0.0)
        return (self._since_first(next_first) - registering, max(done - last_bucket, 0.0))


def _future_for(buf):
    """A future DDP can wait on; for a CUDA bucket a CUDA-aware one (torch syncs the streams)."""
    if buf.is_cuda:
        return torch.futures.Future(devices=[buf.device])
    return torch.futures.Future()


def _on_device(device):
    """Makes `device` current for collectives issued from this thread (the completion thread's
    current CUDA device is 0 otherwise)."""
    if device is not None and device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def register(ddp_model, socket=None, *, optimizer=None, lr=None, dense_iterations=2,
             on_error="fallback", timeout=60.0, connect_timeout=10.0, process_group=None,
             prefix=None, tensors="buckets", announce="rank0", device_path="auto",
             agreement="auto", momentum_correction=False):
    """Installs the sparsecar communication hook on `ddp_model` and returns its state.

    socket: the local daemon's Unix socket (default $SPARSECAR_SOCKET or
        /run/sparsecar/sparsecard.sock). optimizer / lr: where the learning rate sent with each
        step comes from (optimizer.param_groups[0]["lr"], a float, or a callable).
    tensors: "buckets" (default: one flat tensor per DDP bucket, "<prefix>.<index>") or
        "parameters" (one sparsecar tensor per parameter, named as in
        ddp_model.module.named_parameters(), with its shape: per-tensor overrides and the shaped
        selectors apply). prefix: prepended to the names ("<prefix>.<name>" / "<prefix>.<index>").
    dense_iterations: plain all-reduce iterations before switching (>= 2, see the module doc).
    on_error: "fallback" (warn once, plain all-reduce) or "raise".
    announce: "rank0" (one line on stderr from rank 0 when sparsecar takes over), "all" (every
        rank, with its rank), None (logged only).
    device_path: for CUDA buckets, "auto" (default: each bucket is copied into a float32 GPU buffer
        that the daemon maps by CUDA IPC and compresses on its GPU; when the daemon cannot — built
        without CUDA, no GPU — one warning and the buckets are staged through host memory), "off"
        (always host staging), "require" (no fallback to host staging: registering fails).
    agreement: how the ranks agree that every rank got every bucket: "auto" (default: a gloo side
        group when DDP's group is the default NCCL one, so no GPU stream is waited on; else
        DDP's group), "device" (DDP's group, a tensor on the bucket's device), "gloo" (a gloo side
        group; with process_group= every rank of the default group must call register()).
    momentum_correction: False (default) or True: the hook takes SGD momentum over from
        `optimizer` (DGC's momentum correction; see "Momentum correction" in the module doc), so
        that error feedback's delayed coordinates are not amplified by the trainer's momentum
        (a dense -> sparse switch then stops costing accuracy). `optimizer` must be a
        torch.optim.SGD whose param groups all have the same momentum m > 0, dampening 0 and
        nesterov False (else ValueError, before anything else happens); the hook sets their
        momentum to 0, drops their momentum buffers and logs one line. On dense steps the update
        is exactly SGD with momentum m; weight decay stays in the optimizer, outside the momentum.
        The daemon must use its default error_feedback = "residual".
    timeout: seconds to wait for one bucket. Call this on every rank, like DDP itself (it runs
    one small all-reduce so that every rank agrees the daemon is reachable).
    """
    module = getattr(ddp_model, "module", ddp_model)
    names = {id(p): name for name, p in module.named_parameters()}
    first = next(module.parameters(), None)
    device = first.device if first is not None else None
    state = SparsecarHook(socket, optimizer=optimizer, lr=lr, dense_iterations=dense_iterations,
                          on_error=on_error, timeout=timeout, connect_timeout=connect_timeout,
                          process_group=process_group, prefix=prefix, tensors=tensors,
                          param_names=names, device=device, announce=announce, device_path=device_path,
                          agreement=agreement, momentum_correction=momentum_correction,
                          static_graph=_static_graph_of(ddp_model))
    state._connect()
    ddp_model.register_comm_hook(state, _hook_entry)
    return state


def _static_graph_of(ddp_model):
    """A callable: whether `ddp_model` (a DDP model, held weakly: it holds the hook) is a
    static_graph one now."""
    model = weakref.ref(ddp_model)
    return lambda: bool(getattr(model(), "static_graph", False))


def _hook_entry(state, bucket):
    return state(bucket)
