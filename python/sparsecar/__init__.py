"""sparsecar: hand gradients to the local sparsecar daemon (sparsecard) and get the average back.

    import sparsecar
    with sparsecar.Client("/run/sparsecar/sparsecard.sock") as c:
        w = c.register("fc.weight", 5000)         # every tensor, before the first step
        w.array()[:] = grad                        # or c.submit(w, step, data=grad)
        c.submit(w, step, lr=0.1)
        info = c.wait(w, step)                     # w.array() now holds the job-wide average

A registered tensor's shared-memory slot is exposed without a copy: ``tensor.array()`` is a
NumPy float32 view of it and ``sparsecar.as_torch(tensor)`` a torch tensor on the same memory.
Blocking calls release the GIL; one Client may be used from several threads (calls are
serialised; ``wait`` waits in short slices so another thread can submit meanwhile).

GPU tensors stay on the GPU: ``c.register_device(name, t.numel(), **sparsecar.device_handles(t,
ready, done))`` hands the daemon CUDA IPC handles of a CUDA tensor ``t`` and of two
``torch.cuda.Event(interprocess=True)``; per step record ``ready`` on the stream that wrote the
gradient, submit, wait, then make the stream wait on ``done`` before reading the average. A daemon
without CUDA or GPU refuses with sparsecar.Unavailable (register a host tensor then).

PyTorch DDP: ``sparsecar.torch.register(ddp_model, socket=...)`` (see sparsecar/torch.py).
"""

import numpy as _np

from ._sparsecar import (MAX_DIMS, DeadlineExceeded, Error, StepInfo, Tensor, Unavailable, _Client,
                         kernels, set_log_level)

__all__ = ["Client", "Tensor", "StepInfo", "Error", "DeadlineExceeded", "Unavailable", "kernels",
           "as_torch", "device_handles", "set_log_level", "DEFAULT_SOCKET", "MAX_DIMS"]
__version__ = "0.1.0"

DEFAULT_SOCKET = "/run/sparsecar/sparsecard.sock"


def _is_torch(x):
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def as_torch(tensor):
    """A torch tensor sharing the slot's memory (zero-copy; needs torch)."""
    import torch
    return torch.from_numpy(tensor.array())


def _uuid_bytes(uuid):
    """The 16 bytes of a torch device UUID (``get_device_properties(i).uuid``): its ``bytes`` where
    torch has them, else parsed from its text ("GPU-8f2c..." or "8f2c1a3e-...")."""
    raw = getattr(uuid, "bytes", None)
    if raw is not None:
        raw = bytes(raw)
        if len(raw) == 16:
            return raw
    import uuid as _uuid
    text = str(uuid)
    if text.startswith("GPU-"):
        text = text[4:]
    return _uuid.UUID(text).bytes


def device_handles(tensor, ready_event, done_event):
    """The keyword arguments of ``Client.register_device`` for CUDA float32 tensor `tensor` and two
    ``torch.cuda.Event(interprocess=True)``: the device UUID, the CUDA IPC handle of the allocation
    holding the tensor and the tensor's byte offset in it, and both events' IPC handles.

        ready, done = torch.cuda.Event(interprocess=True), torch.cuda.Event(interprocess=True)
        t = c.register_device(name, g.numel(), **sparsecar.device_handles(g, ready, done))

    The shape is not among them (pass ``shape=tuple(t.shape)`` to register it). The tensor must be
    contiguous and stay allocated (keep a reference) as long as it is registered. Needs torch 2.x with CUDA (exercised on the GPU machine; Debian's CPU torch
    cannot run it)."""
    import torch
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"device_handles: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cuda":
        raise ValueError(f"device_handles: the tensor is on {tensor.device}, not a CUDA device; register a host "
                         "tensor with Client.register instead")
    if tensor.dtype != torch.float32:
        raise ValueError(f"device_handles: the tensor is {tensor.dtype}; sparsecar's device tensors are float32")
    if not tensor.is_contiguous():
        raise ValueError("device_handles: the tensor is not contiguous")
    storage = tensor.untyped_storage()
    # (device, handle, storage size, storage offset in the allocation, ...): the handle is the
    # caching allocator's block, which may hold other tensors too.
    shared = storage._share_cuda_()
    handle, storage_offset = _ipc_mem_handle(bytes(shared[1])), int(shared[3])
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):  # an event not recorded yet is created on the current device
        ready, done = bytes(ready_event.ipc_handle()), bytes(done_event.ipc_handle())
    return {
        "device_uuid": _uuid_bytes(torch.cuda.get_device_properties(index).uuid),
        "mem_handle": handle,
        "offset": storage_offset + tensor.storage_offset() * tensor.element_size(),
        "ready_event": ready,
        "done_event": done,
    }


def _ipc_mem_handle(raw):
    """torch's shareable handle of a CUDA storage as the cudaIpcMemHandle_t (64 bytes) inside it.
    torch up to 2.1 gives the 64 bytes; later versions prefix a format version byte and a kind
    byte: b"c" for a cudaMalloc'd segment (the handle follows), b"e" for an expandable segment,
    which has no cudaIpcMemHandle_t."""
    if len(raw) == 64:
        return raw
    if len(raw) == 66 and raw[1:2] == b"c":
        return raw[2:]
    if len(raw) >= 2 and raw[1:2] == b"e":
        raise ValueError("device_handles: the tensor lives in an expandable segment of torch's caching allocator "
                         "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which CUDA IPC handles cannot share; "
                         "unset that option or register a host tensor")
    raise ValueError(f"device_handles: torch's IPC handle has {len(raw)} bytes in a format this sparsecar does not "
                     "know (expected 64, or 66 starting with a version byte and b'c')")


def copy_into(dst_view, data):
    """Copies NumPy array / torch tensor / sequence `data` into the float32 view `dst_view`."""
    if _is_torch(data):
        import torch
        src = data.detach()
        if src.numel() != dst_view.size:
            raise ValueError(f"data has {src.numel()} elements, the tensor {dst_view.size}")
        torch.from_numpy(dst_view).view(-1).copy_(src.reshape(-1))
        return
    src = _np.asarray(data)
    if src.size != dst_view.size:
        raise ValueError(f"data has {src.size} elements, the tensor {dst_view.size}")
    _np.copyto(dst_view.reshape(-1), src.reshape(-1), casting="same_kind")


def copy_out(src_view, out):
    """Copies the float32 view into NumPy array / torch tensor `out` (in place)."""
    if _is_torch(out):
        import torch
        out.view(-1).copy_(torch.from_numpy(src_view).view(-1))
        return
    if out.size != src_view.size:
        raise ValueError(f"out has {out.size} elements, the tensor {src_view.size}")
    _np.copyto(out.reshape(-1), src_view.reshape(-1), casting="same_kind")


class Client:
    """A session with the local daemon. ``socket`` is its Unix socket path; ``timeout`` (s) is how
    long connecting keeps retrying while the socket is missing or refusing. Errors raise
    sparsecar.Error (``.code_name`` e.g. "UNAVAILABLE"), DeadlineExceeded or Unavailable."""

    def __init__(self, socket=DEFAULT_SOCKET, timeout=10.0):
        self._c = _Client.connect(str(socket), float(timeout))

    def register(self, name, size):
        """Registers a float32 tensor of `size` elements (an int) or of a shape (a tuple of 1 to
        MAX_DIMS dims, which the daemon's structured selectors use) and maps its slot. Every tensor of the job must be registered before the first submit, in the same
        order on every trainer."""
        return self._c.register(name, size)

    def register_device(self, name, count, *, device_uuid, mem_handle, offset, ready_event, done_event,
                        shape=None):
        """Registers a float32 tensor of `count` elements that lives in GPU memory, by CUDA IPC
        handles (``sparsecar.device_handles(tensor, ready, done)`` makes these keyword arguments):
        device_uuid (16 bytes), mem_handle / ready_event / done_event (64 bytes each), offset (bytes
        from the allocation's base). No host slot: the Tensor's ``on_device`` is True and
        ``array()`` raises. submit/wait work as for host tensors; the trainer records
        `ready_event` on its stream before submit, and its stream waits on `done_event` after wait.
        A daemon without CUDA or without a GPU raises sparsecar.Unavailable (register a host
        tensor then; the session stays usable)."""
        return self._c.register_device(name, int(count), device_uuid=device_uuid, mem_handle=mem_handle,
                                       offset=int(offset), ready_event=ready_event, done_event=done_event,
                                       shape=None if shape is None else tuple(shape))

    def submit(self, tensor, step, lr=0.0, data=None, trainer_reduces=False, takes_lease=False):
        """Hands the slot's contents for `step` to the daemon (non-blocking). With `data` (a NumPy
        array or torch tensor of the same size) the slot is filled from it first.
        trainer_reduces=True says this trainer all-reduces a dense step itself when the daemon
        answers with StepInfo.trainer_reduces (the knob dense_collective=trainer, where every
        trainer of the job says so; the DDP hook does): the slot then holds this trainer's share,
        to be summed over every trainer and divided by their number. takes_lease=True (with
        trainer_reduces) asks for StepInfo.lease_steps: how many of the next steps the trainer may
        all-reduce itself without submitting them (the knob trainer_lease)."""
        if data is not None:
            copy_into(tensor.array(), data)
        self._c.submit(tensor, int(step), float(lr), bool(trainer_reduces), bool(takes_lease))

    def wait(self, tensor, step, timeout=30.0, out=None):
        """Waits for (tensor, step); then the slot holds the averaged gradient. With `out` the
        average is also copied into it. Returns a StepInfo (bytes_sent, dense_bytes, nnz,
        trainer_reduces, lease_steps)."""
        info = self._c.wait(tensor, int(step), float(timeout))
        if out is not None:
            copy_out(tensor.array(), out)
        return info

    def allreduce(self, tensor, data, step, lr=0.0, timeout=30.0):
        """submit + wait: replaces `data` (NumPy array or torch tensor) in place by the average."""
        self.submit(tensor, step, lr=lr, data=data)
        return self.wait(tensor, step, timeout=timeout, out=data)

    def report_metric(self, name, value, step):
        """Reports a named scalar (e.g. "loss") for a step to the daemon."""
        self._c.report_metric(str(name), float(value), int(step))

    def close(self):
        """Ends the session (once no array view of its slots is alive any more)."""
        self._c.close()

    @property
    def closed(self):
        return self._c.closed

    @property
    def socket(self):
        return self._c.socket

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
