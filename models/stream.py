"""Frozen layers streamed from host memory (docs/DESIGN.md §10, invariant I6).

A frozen layer needs no gradient and no optimizer state: only its weights, for a moment in the forward and again in
the backward (the input gradient of a matmul needs the weight). :class:`LayerStream` keeps those weights in host
memory (pinned on CUDA, in the dtype they compute in) and materialises at most ``window`` layers on the device at
once:

- forward: a pre-hook on each streamed layer points its parameters at a device copy (made ahead, on a side CUDA
  stream, while the previous layer computes) and a post-hook points them back at an empty placeholder;
- backward: what autograd saves of a streamed weight is packed as a reference (layer, name, view), not the tensor
  (``torch.autograd.graph.saved_tensors_hooks``), and unpacked by copying the layer in again, the layer below
  prefetched meanwhile; with recompute (``torch.utils.checkpoint``) the recomputed forward runs the hooks again.

The values a layer computes with are the host copy's, bit for bit, so a streamed visit's loss, gradients and
block are those of the resident one. The active block, its gradients and its optimizer state stay on the device.

    stream = LayerStream(model, layers=range(hi, n), device=cuda, window=2)   # before model.to(cuda)
    with stream.saving():
        loss = visit_loss(model, x, y, lo, from_acts)                           # then loss.backward()
    stream.peak_live, stream.bytes_copied
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from torch import nn

_W = "bcdflow-stream"


class LayerStream:
    """The streamed layers of one model part: their host weights and the device copies alive now."""

    def __init__(self, model: nn.Module, layers: Iterable[int], device: torch.device | str, window: int = 2):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.device, self.window = torch.device(device), window
        self.order = sorted(int(i) for i in layers)
        cuda = self.device.type == "cuda"
        self.host: dict[int, dict[str, torch.Tensor]] = {}
        self.params: dict[int, list[tuple[str, nn.Parameter]]] = {}
        self.live: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self.ptrs: dict[int, tuple[int, str]] = {}  # storage address of a live device weight -> (layer, name)
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.peak_live = self.copies = self.bytes_copied = 0
        """peak_live: the most layers whose device copies were alive at once (freed ones are off by a finalizer)."""
        self._alive: dict[int, int] = {}
        self._last: int | None = None
        self._step = +1
        self._pointed: set[int] = set()
        self.host_bytes = 0
        for i in self.order:
            layer = model.h[str(i)]
            named = list(layer.named_parameters())
            if any(p.requires_grad for _, p in named):
                raise ValueError(f"layer {i} has trainable parameters: only frozen layers stream")
            host = {}
            for name, p in named:
                t = p.detach().to("cpu", copy=True).contiguous()
                host[name] = t.pin_memory() if cuda else t
                self.host_bytes += t.numel() * t.element_size()
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)  # placeholder until materialised
            self.host[i], self.params[i] = host, named
            layer.register_forward_pre_hook(self._before(i))
            layer.register_forward_hook(self._after(i))

    # -- device copies ---------------------------------------------------------------------------------------
    def _drop(self, i: int) -> None:
        for t in self.live.pop(i).values():
            self.ptrs.pop(t.untyped_storage().data_ptr(), None)
        self._point(i, None)

    def _point(self, i: int, dev: dict[str, torch.Tensor] | None) -> None:
        """Layer ``i``'s parameters at its device copy, or (None) at empty placeholders. A recompute in backward
        may stop a layer's forward early (checkpoint's early stop): its post-hook never runs, so a layer is also
        unpointed when it leaves the window or another layer is pointed."""
        if dev is None:
            if i in self._pointed:
                self._pointed.discard(i)
                for _, p in self.params[i]:
                    p.data = torch.empty(0, dtype=p.dtype, device=self.device)
            return
        for k in list(self._pointed):
            if k != i:
                self._point(k, None)
        for name, p in self.params[i]:
            p.data = dev[name]
        self._pointed.add(i)

    def _copy_in(self, i: int) -> dict[str, torch.Tensor]:
        """Layer ``i``'s weights on the device (on the side stream on CUDA; ``materialize`` waits for it)."""
        while len(self.live) >= self.window:
            self._drop(next(iter(self.live)))
        if self.copy_stream is not None:
            with torch.cuda.stream(self.copy_stream):
                dev = {n: h.to(self.device, non_blocking=True) for n, h in self.host[i].items()}
        else:
            dev = {n: h.clone() for n, h in self.host[i].items()}
        self.live[i] = dev
        for n, t in dev.items():
            self.ptrs[t.untyped_storage().data_ptr()] = (i, n)
            self.bytes_copied += t.numel() * t.element_size()
            self._alive[i] = self._alive.get(i, 0) + 1
            weakref.finalize(t.untyped_storage(), self._freed, i)
        self.copies += 1
        self.peak_live = max(self.peak_live, sum(1 for v in self._alive.values() if v))
        return dev

    def _freed(self, i: int) -> None:
        self._alive[i] -= 1

    def materialize(self, i: int) -> dict[str, torch.Tensor]:
        """Layer ``i``'s device weights, ready for compute on the current stream."""
        dev = self.live.get(i)
        if dev is None:
            dev = self._copy_in(i)
        else:
            self.live.move_to_end(i)
        if self.copy_stream is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_stream(self.copy_stream)
            for t in dev.values():
                t.record_stream(cur)  # freed only once the compute that reads it is done
        return dev

    def _prefetch(self, i: int, step: int) -> None:
        """Start copying the next layer in the walk's direction where the window has room (CUDA only: on the CPU a
        copy is not asynchronous, so it waits for its use)."""
        k = self.order.index(i) + step
        if self.copy_stream is None or not 0 <= k < len(self.order) or len(self.live) >= self.window:
            return
        if self.order[k] not in self.live:
            self._copy_in(self.order[k])

    def _walk(self, i: int) -> int:
        """+1 while the layers go up (the forward), -1 while they go down (backward, recompute included); layers
        above ``i`` are done on the way down and leave the window."""
        step = -1 if self._last is not None and i < self._last else +1
        self._last, self._step = i, step
        if step < 0:
            for k in [k for k in self.live if k > i]:
                self._drop(k)
        return step

    # -- the forward: parameters pointed at the device copy for the layer's call -----------------------------
    def _before(self, i: int):
        def hook(module, args):
            step = self._walk(i)
            self._point(i, self.materialize(i))
            self._prefetch(i, step)
        return hook

    def _after(self, i: int):
        def hook(module, args, out):
            self._point(i, None)
            if self._step > 0 and i in self.live and i != self.order[-1]:
                self._drop(i)  # not needed again until the backward, which copies it in again
        return hook

    # -- the backward: saved weights as references ------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if t.device == self.device and t.numel():
            key = self.ptrs.get(t.untyped_storage().data_ptr())
            if key is not None:
                return (_W, *key, t.size(), t.stride(), t.storage_offset())
        return t

    def _unpack(self, packed):
        if isinstance(packed, tuple) and packed and packed[0] == _W:
            _, i, name, size, stride, offset = packed
            step = self._walk(i)
            base = self.materialize(i)[name]
            self._prefetch(i, step)
            return base.as_strided(size, stride, offset)
        return packed

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Around a forward whose backward will run: streamed weights are saved as references."""
        self._last = None  # a new forward starts from the bottom
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def release(self) -> None:
        """Drop every device copy (between steps the window holds the last layers used; at the end, nothing)."""
        for i in list(self.live):
            self._drop(i)
        for i in list(self._pointed):
            self._point(i, None)

