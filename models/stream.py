"""Frozen layers streamed from host memory (docs/DESIGN.md §10, invariant I6).

A frozen layer needs no gradient and no optimizer state: only its weights, for a moment in the forward and again in
the backward (the input gradient of a matmul needs the weight). :class:`LayerStream` keeps those weights in host
memory and computes with them in a fixed set of device buffers:

- host: one flat buffer per layer (page-locked on CUDA with ``cudaHostRegister``, exactly its size: torch's pinned
  allocator would round every request up to a power of two), the layer's tensors as aligned views
  (:func:`layer_bytes` is the size, which the planner counts too);
- device: ``window`` slot buffers, each one flat buffer the size of the largest streamed layer. A layer is copied
  into a slot in one copy (on a side CUDA stream) and its parameters are views into the slot. The copy stream
  waits for the compute stream's "done with this slot" event before overwriting it, and the compute stream waits
  for the copy's "ready" event before using it, so device memory for streamed weights is exactly ``window`` slots
  however far ahead of the GPU the host runs (no allocation per copy, no ``record_stream``, no host sync);
- which slot holds which layer: :class:`SlotPlan`, Belady's rule on the step's known use order
  (:class:`Schedule`: the forward up through every streamed layer, then the backward down through those on the
  gradient path, then the next step): at each use the next ``window - 1`` distinct layers are copied in ahead,
  evicting the layer whose next use is farthest. So the first suffix layer, the first backward layer and the next
  step's first layers are prefetched too. The CPU runs the same slots, plan and counts (its copies are
  synchronous), so the CPU tests check what the GPU holds.

Forward: a pre-hook points the layer's parameters at its slot's views, a post-hook back at empty placeholders.
Backward: what autograd saves of a streamed weight is packed as a reference (layer, name, view), not the tensor
(``torch.autograd.graph.saved_tensors_hooks``), and unpacked from the layer's slot, copied in again if it left;
with recompute (``torch.utils.checkpoint``) the recomputed forward runs the hooks again. A saved tensor that lies in
a slot but is no streamed weight's view would be overwritten silently later: it is refused at once.

The values a layer computes with are the host copy's, bit for bit, so a streamed visit's loss, gradients and
block are those of the resident one. Only a layer's frozen parameters stream (anything trainable in it stays where
it is); the active block, its gradients and its optimizer state stay on the device.

    stream = LayerStream(model, layers=range(hi, n), device=cuda, window=2, grad_from=lo)   # before model.to(cuda)
    with stream.saving():
        loss = visit_loss(model, x, y, lo, from_acts)                                          # then loss.backward()
    stream.bytes_copied, stream.copies, stream.host_bytes, stream.slot_bytes
    stream.close()                                                                             # frees slots and host
"""
from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from torch import nn

from bcdflow.models.build import place
from bcdflow.models.errors import ConfigError

_W = "bcdflow-stream"
ALIGN = 256
"""Bytes: every tensor in a flat layer buffer starts at a multiple (vector loads of CUDA kernels; cudaMalloc itself
aligns to 512), so a view of any dtype is aligned."""


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def layer_bytes(sizes: Iterable[int]) -> int:
    """Bytes of one layer's flat buffer, host or slot: its tensors' bytes, each rounded up to :data:`ALIGN`."""
    return sum(aligned(n) for n in sizes)


def host_buffer(nbytes: int, pin: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """A flat uint8 host buffer of exactly ``nbytes``, page-locked (CUDA, for ``device``'s context and the others:
    ``cudaHostRegisterPortable``) with ``cudaHostRegister`` as torch's own checkpoint stager does, and unregistered
    when the buffer is freed. A host that cannot page-lock it is bad input (no retry): its limits are the machine's."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if pin and nbytes:
        cudart = torch.cuda.cudart()
        with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
            err = int(cudart.cudaHostRegister(buf.data_ptr(), nbytes, 1))
        if err:
            clear_cuda_error()
            raise ConfigError(f"train.offload: page-locking {nbytes / 1e9:.2f} GB of host memory failed (cudaError "
                              f"{err}): raise the host's locked-memory limit (ulimit -l) or free memory, or hold "
                              "more layers on the device (train.offload=off)")
        fin = weakref.finalize(buf.untyped_storage(), cudart.cudaHostUnregister, buf.data_ptr())
        fin.atexit = False  # not after the CUDA context is gone
    return buf


def clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a call that failed and was handled (``cudaHostRegister``): left set,
    torch's check after the next kernel launch (``cudaGetLastError``) would raise it there, from an unrelated op.
    torch binds no ``cudaGetLastError``, so it is called in the runtime torch loaded; where none is found (a static
    runtime), a one-element kernel launch consumes it (its check reads and resets the error, and raises it)."""
    lib = _cudart_lib()
    if lib is not None:
        lib.cudaGetLastError()
        return
    try:
        torch.zeros(1, device="cuda").add_(1)
    except RuntimeError:
        pass


def _cudart_lib():
    try:
        with open("/proc/self/maps") as f:
            path = next((ln.split(maxsplit=5)[-1].strip().removesuffix(" (deleted)") for ln in f
                         if "libcudart.so" in ln), None)
    except OSError:
        return None
    if path is None:
        return None
    import ctypes

    try:
        return ctypes.CDLL(path)  # already loaded by torch: the same handle, no second runtime
    except OSError:
        return None


def canonical(device: torch.device | str) -> torch.device:
    """``device`` as its tensors name it where that is an index: ``cuda`` -> ``cuda:N`` (N the current device).
    Code here compares device types and storage addresses, never ``torch.device`` objects (``cuda`` != ``cuda:0``)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _view(flat: torch.Tensor, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return flat[offset:offset + n].view(dtype).view(shape)


class Schedule:
    """The order in which one step uses the streamed layers: the forward up through all of them, then, when a
    backward follows (training), down through those on the gradient path (``>= grad_from``); then the next step.
    Recompute re-runs a layer's forward in the backward: the same use as that layer's backward."""

    def __init__(self, order: Iterable[int], grad_from: int | None):
        self.fwd = sorted(order)
        self.bwd = [i for i in reversed(self.fwd) if grad_from is not None and i >= grad_from]

    def seq(self, train: bool) -> list[int]:
        return self.fwd + self.bwd if train else list(self.fwd)

    def pos(self, i: int, backward: bool, train: bool) -> int | None:
        """Where in ``seq(train)`` a use of layer ``i`` is (None: a use the schedule does not foresee)."""
        try:
            return len(self.fwd) + self.bwd.index(i) if backward and train else self.fwd.index(i)
        except ValueError:
            return None


class SlotPlan:
    """Which layer each of ``window`` slots holds, and the copies each use needs: the used layer if it is not in a
    slot (a demand copy), then the next ``window - 1`` distinct layers of the cyclic schedule (prefetches), each
    into a free slot or the slot of the layer used farthest in the future (Belady's rule), and only where that one's
    next use is later than the prefetched layer's. Pure bookkeeping: the stream makes the copies it returns, the
    planner counts them (``models/memory.stream_traffic``)."""

    def __init__(self, window: int):
        self.window = window
        self.holds: list[int | None] = [None] * window
        self._occ: tuple[tuple[int, ...], dict[int, list[int]]] | None = None

    def _next_use(self, seq: list[int], p: int, j: int | None) -> float:
        if j is None:
            return math.inf
        if self._occ is None or self._occ[0] != tuple(seq):
            occ: dict[int, list[int]] = {}
            for q, k in enumerate(seq):
                occ.setdefault(k, []).append(q)
            self._occ = (tuple(seq), occ)
        return min(((q - p) % len(seq) for q in self._occ[1].get(j, ())), default=math.inf)

    def _victim(self, seq: list[int], p: int | None, later_than: float) -> int | None:
        """A free slot, else the slot whose layer is used farthest ahead, if that is later than ``later_than``."""
        if None in self.holds:
            return self.holds.index(None)
        if p is None:  # an unforeseen use: any slot but the current layer's
            return 0
        far = max(range(self.window), key=lambda k: self._next_use(seq, p, self.holds[k]))
        return far if self._next_use(seq, p, self.holds[far]) > later_than else None

    def use(self, seq: list[int], p: int | None, i: int) -> list[tuple[int, int]]:
        """Copies (layer, slot) to make, in order, for a use of layer ``i`` at position ``p`` of ``seq``."""
        copies = []
        if i not in self.holds:
            k = self._victim(seq, p, -1)
            self.holds[k] = i
            copies.append((i, k))
        if p is None or self.window < 2:
            return copies
        ahead: list[int] = []
        for s in range(1, len(seq)):
            u = seq[(p + s) % len(seq)]
            if u == i or u in ahead:
                continue
            ahead.append(u)
            if u not in self.holds:
                k = self._victim(seq, p, s)
                if k is None:
                    break
                self.holds[k] = u
                copies.append((u, k))
            if len(ahead) == self.window - 1:
                break
        return copies


class LayerStream:
    """The streamed layers of one model part: their flat host buffers, the device slots and which layer is where.
    ``grad_from``: the first layer on the gradient path (the active block's first; None: no backward, e.g. the
    pre-inference prefix or an evaluation model)."""

    def __init__(self, model: nn.Module, layers: Iterable[int], device: torch.device | str, window: int = 2,
                 grad_from: int | None = None):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.device = canonical(device)
        self.cuda = self.device.type == "cuda"
        self.sched = Schedule(layers, grad_from)
        self.order = self.sched.fwd
        self.window = window = max(1, min(window, len(self.order)))  # more slots than layers would hold nothing
        self.plan = SlotPlan(window)
        # per layer: (name, parameter, byte offset in the flat buffer, bytes, shape); frozen parameters only
        self.layout: dict[int, list[tuple[str, nn.Parameter, int, int, torch.Size]]] = {}
        self.host: dict[int, torch.Tensor] = {}
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        for i in self.order:
            named = [(n, p) for n, p in model.h[str(i)].named_parameters() if not p.requires_grad]
            entries, off = [], 0
            for name, p in named:
                nbytes = p.numel() * p.element_size()
                entries.append((name, p, off, nbytes, p.shape))
                off += aligned(nbytes)
            flat = host_buffer(off, pin=self.cuda, device=self.device)
            with torch.no_grad():
                for name, p, o, _, shape in entries:  # one copy, straight into the flat buffer (no staging)
                    if not p.is_meta:  # a meta-built layer's values are copied in later (host_tensor)
                        _view(flat, o, p.dtype, shape).copy_(p.detach())
                    place(p, self._placeholder(p.dtype))
            self.layout[i], self.host[i] = entries, flat
            layer = model.h[str(i)]
            layer.register_forward_pre_hook(self._before(i))
            layer.register_forward_hook(self._after(i))
        self.host_bytes = sum(h.numel() for h in self.host.values())
        """Host bytes the streamed layers take, as allocated (and, on CUDA, as page-locked)."""
        self._by_name = {f"h.{i}.{e[0]}": (i, e) for i, es in self.layout.items() for e in es}
        self.slot_bytes = max((h.numel() for h in self.host.values()), default=0)
        self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(window)]
        self._slot_of_ptr = {s.untyped_storage().data_ptr(): k for k, s in enumerate(self.slots)}
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._ready = [torch.cuda.Event() for _ in range(window)] if self.cuda else []
        self._free = [torch.cuda.Event() for _ in range(window)] if self.cuda else []
        # dropped without close() (an error mid-visit, a context evicted), the slots and page-locked buffers must not
        # be freed (unregistered, reused) under a copy still in flight on the side stream: the finalizer holds them
        # until that stream is done (it references no self, so it does not keep the stream object alive)
        self._drain = weakref.finalize(self, _drain, self.copy_stream, self.slots, self.host)
        self._drain.atexit = False
        self._pointed: int | None = None
        self._train = self._saving = False
        self.copies = self.bytes_copied = 0
        self.storages: set[int] = set()
        """Storage addresses that streamed weights were computed from: the slots' and nothing else (tests)."""

    @property
    def device_bytes(self) -> int:
        """Device bytes the streamed weights take: ``window`` slots, whatever the number of streamed layers."""
        return self.window * self.slot_bytes

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return self._placeholders[dtype]

    # -- slots -------------------------------------------------------------------------------------------------
    def _copy(self, i: int, k: int) -> None:
        """Layer ``i``'s flat buffer into slot ``k`` (on the side stream on CUDA, after the compute stream is done
        with what the slot held)."""
        if self._pointed is not None and self._pointed not in self.plan.holds:
            self._point(self._pointed, None)  # its slot is about to hold another layer
        src, dst = self.host[i], self.slots[k][: self.host[i].numel()]
        if self.cuda:
            self._free[k].record(torch.cuda.current_stream(self.device))
            self.copy_stream.wait_event(self._free[k])
            with torch.cuda.stream(self.copy_stream):
                dst.copy_(src, non_blocking=True)
            self._ready[k].record(self.copy_stream)
        else:
            dst.copy_(src)
        self.copies += 1
        self.bytes_copied += src.numel()

    def _use(self, i: int, backward: bool) -> int:
        """Make layer ``i`` ready in its slot for the current stream (copying in what the plan says) -> the slot."""
        seq = self.sched.seq(self._train)
        pos = self.sched.pos(i, backward, self._train)
        for layer, k in self.plan.use(seq, pos, i):
            self._copy(layer, k)
        k = self.plan.holds.index(i)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._ready[k])
        return k

    def _views(self, i: int, k: int) -> dict[str, torch.Tensor]:
        slot = self.slots[k]
        self.storages.add(slot.untyped_storage().data_ptr())
        return {name: _view(slot, off, p.dtype, shape) for name, p, off, _, shape in self.layout[i]}

    def _point(self, i: int, views: dict[str, torch.Tensor] | None) -> None:
        """Layer ``i``'s parameters at its slot's views, or (None) at empty placeholders. One layer is pointed at a
        time: a recompute's forward may stop early (checkpoint's early stop) and skip its post-hook."""
        if views is None:
            if self._pointed == i:
                for _, p, _, _, _ in self.layout[i]:
                    p.data = self._placeholder(p.dtype)
                self._pointed = None
            return
        if self._pointed is not None and self._pointed != i:
            self._point(self._pointed, None)
        for name, p, *_ in self.layout[i]:
            p.data = views[name]
        self._pointed = i

    @contextmanager
    def pointed(self, i: int, backward: bool = False) -> Iterator[None]:
        """Layer ``i``'s parameters at its slot for a call that bypasses the layer's hooks (``layer.forward``);
        ``backward``: part of a walk down the gradient path (the slots plan and prefetch for it)."""
        if backward:
            self._train = True
        self._point(i, self._views(i, self._use(i, backward)))
        try:
            yield
        finally:
            self._point(i, None)

    # -- the forward: parameters pointed at the slot for the layer's call --------------------------------------
    def _before(self, i: int):
        def hook(module, args):
            backward = torch._C._current_graph_task_id() != -1  # a recompute in the backward
            if not backward:
                self._train = self._saving  # a forward outside ``saving()`` has no backward (evaluation, prefix)
            self._point(i, self._views(i, self._use(i, backward)))
        return hook

    def _after(self, i: int):
        def hook(module, args, out):
            self._point(i, None)
        return hook

    # -- the backward: saved weights as references ------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        # the type, not the device: an unindexed name (``cuda``) is not equal to the ``cuda:0`` a tensor reports, and
        # a weight not packed here is saved as the slot view itself (read overwritten) or as an emptied placeholder.
        # The slot address below is what identifies a streamed weight.
        if not t.numel() or t.device.type != self.device.type:
            return t
        k = self._slot_of_ptr.get(t.untyped_storage().data_ptr())
        if k is None:
            return t
        i, at = self.plan.holds[k], t.data_ptr() - self.slots[k].data_ptr()
        for name, p, off, nbytes, _ in self.layout.get(i, ()):
            if off <= at < off + nbytes and t.dtype == p.dtype:
                return (_W, i, name, t.size(), t.stride(), (at - off) // t.element_size())
        raise RuntimeError(f"autograd saved a tensor inside stream slot {k} (layer {i}) that is no streamed weight: "
                           "the slot is reused, so it would be read overwritten")

    def _unpack(self, packed):
        if isinstance(packed, tuple) and packed and packed[0] == _W:
            _, i, name, size, stride, offset = packed
            base = self._views(i, self._use(i, backward=True))[name]
            return base.as_strided(size, stride, base.storage_offset() + offset)
        return packed

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Around a forward whose backward will run: streamed weights are saved as references, and the slots plan
        for the backward that follows."""
        self._saving = self._train = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._saving = False

    def release(self) -> None:
        """Point every parameter back at its placeholder (the slots keep their layers for the next step)."""
        if self._pointed is not None:
            self._point(self._pointed, None)

    def close(self) -> None:
        """Free the slots and the host buffers (the model's streamed layers are unusable after this)."""
        self.release()
        self.slots, self.host, self._slot_of_ptr = [], {}, {}
        self._drain()  # a prefetch may still be reading a host buffer: unregistering it under the copy is undefined
        self.plan.holds = [None] * self.window

    # -- loading -----------------------------------------------------------------------------------------------
    def host_tensor(self, name: str) -> torch.Tensor | None:
        """The host view that holds streamed weight ``name`` (``h.{i}.…``; None: not a streamed weight): a loader
        writes a stored tensor straight into it (``copy_`` casts to the compute dtype), so a part whose layers were
        built on the meta device never holds its streamed weights twice."""
        hit = self._by_name.get(name)
        if hit is None:
            return None
        i, (_, p, off, _, shape) = hit
        return _view(self.host[i], off, p.dtype, shape)


def _drain(stream, slots: list, host: dict) -> None:
    """What a stream's finalizer does: wait for the side stream's copies, then let the buffers go."""
    if stream is not None:
        stream.synchronize()
    slots.clear()
    host.clear()


class BatchStage:
    """The page-locked host buffers a training loop's batches pass through to a CUDA device: ``slots`` flat buffers
    registered as the stream's are (exactly their size, counted by the planner: ``models/memory.stage_bytes``), not
    torch's pinned allocator (which rounds each batch up to a power of two and keeps it cached). The reading thread
    claims a slot and has the batch written into it (:meth:`alloc`: views of the slot's buffer), the loop thread
    issues its copies (:meth:`to_device`, asynchronous) and records the slot's event; a slot is filled again only
    once that event has passed (its copy has read it). On the CPU batches pass as they are (no slot).

        stage = BatchStage(device)
        k = stage.claim()                                          # reading thread: waits for the slot's last copy
        h, y = stage.alloc(k, [((B, T, C), torch.float32), ((B, T), torch.long)])   # filled by the reader
        h, y = stage.to_device(k, (h, y))                          # loop thread
    """

    def __init__(self, device: torch.device | str, slots: int = 2):
        self.device = canonical(device)
        self.cuda = self.device.type == "cuda"
        self.bufs: list[torch.Tensor | None] = [None] * slots
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0

    @property
    def host_bytes(self) -> int:
        """Bytes of the slots' buffers as allocated (page-locked)."""
        return sum(b.numel() for b in self.bufs if b is not None)

    def claim(self) -> int | None:
        """The next slot, once the copy out of its last batch has completed (None on the CPU)."""
        if not self.cuda:
            return None
        k = self._next
        self._next = (k + 1) % len(self.bufs)
        if self.events[k] is not None:
            self.events[k].synchronize()
        return k

    def alloc(self, k: int | None, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """Host tensors of these shapes and dtypes for one batch: views of slot ``k``'s buffer (grown, registered
        anew, when a batch needs more than it holds: the slot is free once claimed), or plain tensors on the CPU."""
        if k is None:
            return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
        sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
        need = sum(aligned(n) for n in sizes)
        if self.bufs[k] is None or self.bufs[k].numel() < need:
            self.bufs[k] = None  # unregistered and freed before the larger one is locked
            self.bufs[k] = host_buffer(need, pin=True, device=self.device)
        out, off = [], 0
        for (shape, dtype), n in zip(specs, sizes):
            out.append(_view(self.bufs[k], off, dtype, torch.Size(shape)))
            off += aligned(n)
        return out

    def stage(self, tensors: tuple) -> tuple[int | None, tuple]:
        """``tensors`` copied into a claimed slot (the reading thread, for a reader that cannot write into
        :meth:`alloc`'s views) -> (slot, its tensors); on the CPU (None, the tensors as they are)."""
        k = self.claim()
        if k is None:
            return None, tensors
        ts = [t for t in tensors if isinstance(t, torch.Tensor)]
        views = iter(self.alloc(k, [(tuple(t.shape), t.dtype) for t in ts]))
        return k, tuple(next(views).copy_(t) if isinstance(t, torch.Tensor) else t for t in tensors)

    def close(self) -> None:
        """Wait for the copies out of the slots (the loop may end on an exception with one in flight), then free
        them: a page-locked buffer is unregistered when freed, which must not happen under a copy."""
        for ev in self.events:
            if ev is not None:
                ev.synchronize()
        self.bufs = [None] * len(self.bufs)

    def to_device(self, k: int | None, batch: tuple) -> tuple:
        """The batch's tensors on the device (the loop thread): copies on the current stream, then slot ``k``'s
        event, which :meth:`claim` waits for before the slot is written again."""
        out = tuple(t.to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t for t in batch)
        if k is not None:
            if self.events[k] is None:
                self.events[k] = torch.cuda.Event()
            self.events[k].record(torch.cuda.current_stream(self.device))
        return out
