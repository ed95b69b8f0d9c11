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
            raise ConfigError(f"train.offload: page-locking {nbytes / 1e9:.2f} GB of host memory failed (cudaError "
                              f"{err}): raise the host's locked-memory limit (ulimit -l) or free memory, or hold "
                              "more layers on the device (train.offload=off)")
        fin = weakref.finalize(buf.untyped_storage(), cudart.cudaHostUnregister, buf.data_ptr())
        fin.atexit = False  # not after the CUDA context is gone
    return buf


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
        self.device = torch.device(device)
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
                    _view(flat, o, p.dtype, shape).copy_(p.detach())
                    p.data = self._placeholder(p.dtype)
            self.layout[i], self.host[i] = entries, flat
            layer = model.h[str(i)]
            layer.register_forward_pre_hook(self._before(i))
            layer.register_forward_hook(self._after(i))
        self.host_bytes = sum(h.numel() for h in self.host.values())
        """Host bytes the streamed layers take, as allocated (and, on CUDA, as page-locked)."""
        self.slot_bytes = max((h.numel() for h in self.host.values()), default=0)
        self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(window)]
        self._slot_of_ptr = {s.untyped_storage().data_ptr(): k for k, s in enumerate(self.slots)}
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._ready = [torch.cuda.Event() for _ in range(window)] if self.cuda else []
        self._free = [torch.cuda.Event() for _ in range(window)] if self.cuda else []
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

    def materialize(self, i: int) -> dict[str, torch.Tensor]:
        """Layer ``i``'s device weights (views of its slot), ready for compute on the current stream."""
        return self._views(i, self._use(i, backward=torch._C._current_graph_task_id() != -1))

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
        if t.device != self.device or not t.numel():
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
        if self.cuda:  # a prefetch may still be reading a host buffer: unregistering it under the copy is undefined
            self.copy_stream.synchronize()
        self.slots, self.host, self._slot_of_ptr = [], {}, {}
        self.plan.holds = [None] * self.window
