"""PyTorch DistributedDataParallel communication hook that sends gradients through sparsecar.

    model = torch.nn.parallel.DistributedDataParallel(net)       # gloo (or nccl) process group
    hook = sparsecar.torch.register(model, socket="/run/sparsecar/sparsecard.sock", optimizer=opt)
    ...
    loss.backward(); opt.step(); hook.report_metric("loss", loss.item())

How it works (torch 1.13 .. 2.x; only public, long-lived hook APIs are used):

* **Buckets become sparsecar tensors once their layout is stable.** DDP rebuilds its buckets
  after the first iteration (in the order gradients became ready), and sparsecar needs every
  tensor registered before its first step. So the hook runs the first ``dense_iterations``
  iterations (default 2, at least 2) as a plain all-reduce on DDP's process group and records
  the bucket sizes by bucket index; at the last bucket of the first iteration whose layout equals
  the previous one's, it registers one flat float32 tensor per bucket index
  (``"<prefix>.<index>"``), and every rank agrees (one tiny all-reduce) that all of them did.
  From the next iteration on every bucket goes to the daemon. State is keyed by bucket index.
* **The hook returns at once.** It copies the bucket into the tensor's shared-memory slot,
  submits it (with the learning rate) and returns a ``torch.futures.Future``; one completion
  thread per process waits for the daemon in bucket order, copies the average back into the
  bucket and completes the future. DDP's ``backward()`` waits for the futures.
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
* **Counting.** ``hook.stats`` has the daemon-reported wire bytes of this node
  (``sparsecar_bytes``), the dense-equivalent bytes it reports, and the elements that went
  through the dense path (warm-up and fallback) so benchmarks can count them too.

Rules: one sparsecar client per DDP rank (the daemon's --local-clients equals the local ranks),
the daemon averages over all trainers of the job, so the job's trainers must be exactly the DDP
ranks. Gradients must be float32 (otherwise the hook stays on plain all-reduce and warns).
"""

import collections
import logging
import os
import queue
import threading
import warnings

import torch
import torch.distributed as dist

import sparsecar

log = logging.getLogger("sparsecar.torch")

__all__ = ["register", "SparsecarHook"]


class SparsecarHook:
    """The hook's state (one per DDP model). Create it with register()."""

    def __init__(self, socket=None, *, optimizer=None, lr=None, dense_iterations=2,
                 on_error="fallback", timeout=60.0, connect_timeout=10.0, process_group=None,
                 prefix="ddp.bucket"):
        if on_error not in ("fallback", "raise"):
            raise ValueError('on_error must be "fallback" or "raise"')
        self.socket = socket or os.environ.get("SPARSECAR_SOCKET", sparsecar.DEFAULT_SOCKET)
        self.optimizer = optimizer
        self.lr = lr
        self.dense_iterations = max(2, int(dense_iterations))
        self.on_error = on_error
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.process_group = process_group
        self.prefix = prefix
        self.iteration = 0           # iterations whose last bucket has been hooked
        self.mode = "warmup"         # warmup -> sparse -> (fallback); or warmup -> fallback
        self.failure = None          # the first error, as text
        self.stats = collections.Counter()
        self._client = None
        self._tensors = {}           # bucket index -> sparsecar.Tensor
        self._layout = {}            # bucket index -> element count, this iteration
        self._prev_layout = None
        self._in_iteration = False
        self._step_failed = False    # a sparsecar step failed; dense from the next iteration on
        self._warned = False
        self._jobs = queue.Queue()
        self._worker = None
        self._closed = False

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
    def active(self):
        """True while buckets go through sparsecar."""
        return self.mode == "sparse"

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

    # ---- setup -------------------------------------------------------------------------------
    def _connect(self):
        """Connects (all ranks agree whether everyone could). Called by register()."""
        ok = True
        try:
            self._client = sparsecar.Client(self.socket, timeout=self.connect_timeout)
        except sparsecar.Error as e:
            ok = False
            self._note_failure(f"cannot connect to the sparsecar daemon at {self.socket}: {e}")
        if not self._all_ranks_ok(ok):
            if ok:
                self._note_failure("another rank could not connect to its sparsecar daemon")
            self._give_up()

    def _all_ranks_ok(self, ok):
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.process_group)
        return bool(flag.item())

    def _current_lr(self):
        if self.optimizer is not None:
            return float(self.optimizer.param_groups[0]["lr"])
        if callable(self.lr):
            return float(self.lr())
        return float(self.lr or 0.0)

    def _register_buckets(self):
        ok = True
        try:
            for index in sorted(self._layout):
                self._tensors[index] = self._client.register(f"{self.prefix}.{index}", self._layout[index])
        except sparsecar.Error as e:
            ok = False
            self._note_failure(f"registering the DDP buckets with sparsecar failed: {e}")
        if not self._all_ranks_ok(ok):
            if ok:
                self._note_failure("another rank could not register its DDP buckets with sparsecar")
            self._give_up()
            return
        self.mode = "sparse"
        self._worker = threading.Thread(target=self._complete_loop, name="sparsecar-ddp-completion",
                                        daemon=True)
        self._worker.start()
        log.info("sparsecar: %d DDP bucket(s) (%d elements) go through %s from iteration %d",
                 len(self._tensors), sum(self._layout.values()), self.socket, self.iteration + 1)

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

    def _allreduce_async(self, buf):
        self.stats["dense_elements"] += buf.numel()
        self.stats["dense_buckets"] += 1
        world = self._world()
        work = dist.all_reduce(buf, group=self.process_group, async_op=True)
        return work.get_future().then(lambda f: f.value()[0].div_(world))

    def _allreduce_now(self, buf):
        self.stats["dense_elements"] += buf.numel()
        self.stats["dense_buckets"] += 1
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
        index, buf, last = bucket.index(), bucket.buffer(), bucket.is_last()
        step = self.iteration
        if not self._in_iteration:
            # Mode changes only here, between iterations: backward() waited for every future of
            # the previous iteration, so every failure of it is known, and every rank that saw
            # the same failures switches at the same bucket.
            self._in_iteration = True
            if self.mode == "sparse" and self._step_failed:
                self.mode = "fallback"
        if last:
            self._in_iteration = False
        if self.mode == "warmup":
            self._layout[index] = buf.numel() if buf.dtype == torch.float32 else -1
            fut = self._allreduce_async(buf)
            if last:
                self._end_warmup_iteration()
            return fut
        if self.mode == "sparse":
            fut = torch.futures.Future()
            t = self._tensors.get(index)
            if t is None or t.size != buf.numel():
                # Cannot happen after a stable layout unless DDP rebuilt its buckets again.
                self._fail_step(f"bucket {index} has {buf.numel()} elements, registered "
                                f"{t.size if t is not None else 'none'}")
                self._jobs.put(("failed", index, buf, fut, step, last))
            else:
                try:
                    sparsecar.copy_into(t.array(), buf)
                    self._client.submit(t, step, lr=self._current_lr())
                    self._jobs.put(("sparse", index, buf, fut, step, last))
                except sparsecar.Error as e:
                    self._fail_step(f"submitting bucket {index} step {step} failed: {e}")
                    self._jobs.put(("failed", index, buf, fut, step, last))
            if last:
                self.iteration += 1
            return fut
        # fallback (or sparse after a failure): keep the collectives in one thread, in order
        if self._worker is not None:
            fut = torch.futures.Future()
            self._jobs.put(("dense", index, buf, fut, step, last))
            if last:
                self.iteration += 1
            return fut
        fut = self._allreduce_async(buf)
        if last:
            self.iteration += 1
        return fut

    def _end_warmup_iteration(self):
        self.iteration += 1
        layout, self._layout = self._layout, {}
        stable = layout == self._prev_layout
        self._prev_layout = layout
        if self.iteration < self.dense_iterations or not stable:
            return
        self._layout = layout
        if any(n < 0 for n in layout.values()):
            self._note_failure("DDP buckets are not float32; sparsecar handles float32 only")
            self._give_up()
            return
        if self._client is None:
            self._give_up()
            return
        self._register_buckets()

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
        pending = []  # this iteration's sparse / failed buckets: (kind, index, buf, fut, step, info)
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
                info = None
                if kind == "sparse":
                    try:
                        info = self._client.wait(self._tensors[index], step, timeout=self.timeout)
                    except sparsecar.Error as e:
                        self._fail_step(f"bucket {index} step {step} failed: {e}")
                pending.append((kind, index, buf, fut, step, info))
                if last:
                    self._finish_iteration(pending)
                    pending = []
            except Exception as e:  # noqa: BLE001 - must never leave a future unset
                log.exception("sparsecar DDP hook: completing bucket %d step %d failed", index, step)
                for _, _, _, f, _, _ in pending + [(kind, index, buf, fut, step, None)]:
                    if not f.done():
                        f.set_exception(RuntimeError(f"sparsecar DDP hook: {e}"))
                pending = []

    def _finish_iteration(self, pending):
        """Every rank learns whether every rank got every bucket of this iteration, then all use
        the daemon's averages or all all-reduce the original gradients."""
        mine_ok = all(info is not None for _, _, _, _, _, info in pending)
        all_ok = self._all_ranks_ok(mine_ok)
        if not all_ok:
            if mine_ok:
                self._fail_step("another rank's sparsecar step failed in this iteration; every rank "
                                "all-reduces it instead")
            self._step_failed = True
        for kind, index, buf, fut, step, info in pending:
            if all_ok:
                sparsecar.copy_out(self._tensors[index].array(), buf)
                self.stats["sparse_buckets"] += 1
                self.stats["sparsecar_bytes"] += info.bytes_sent
                self.stats["sparsecar_dense_equivalent_bytes"] += info.dense_bytes
                self.stats["sparsecar_nnz"] += info.nnz
                self.stats["sparsecar_elements"] += buf.numel()
                fut.set_result(buf)
            elif self.on_error == "raise":
                fut.set_exception(RuntimeError(f"sparsecar DDP hook: bucket {index} step {step}: {self.failure}"))
            else:
                fut.set_result(self._allreduce_now(buf))  # the original gradient: copy_out never ran


def register(ddp_model, socket=None, *, optimizer=None, lr=None, dense_iterations=2,
             on_error="fallback", timeout=60.0, connect_timeout=10.0, process_group=None,
             prefix="ddp.bucket"):
    """Installs the sparsecar communication hook on `ddp_model` and returns its state.

    socket: the local daemon's Unix socket (default $SPARSECAR_SOCKET or
        /run/sparsecar/sparsecard.sock). optimizer / lr: where the learning rate sent with each
        step comes from (optimizer.param_groups[0]["lr"], a float, or a callable).
    dense_iterations: plain all-reduce iterations before switching (>= 2, see the module doc).
    on_error: "fallback" (warn once, plain all-reduce) or "raise".
    timeout: seconds to wait for one bucket. Call this on every rank, like DDP itself (it runs
    one small all-reduce so that every rank agrees the daemon is reachable).
    """
    state = SparsecarHook(socket, optimizer=optimizer, lr=lr, dense_iterations=dense_iterations,
                          on_error=on_error, timeout=timeout, connect_timeout=connect_timeout,
                          process_group=process_group, prefix=prefix)
    state._connect()
    ddp_model.register_comm_hook(state, _hook_entry)
    return state


def _hook_entry(state, bucket):
    return state(bucket)
