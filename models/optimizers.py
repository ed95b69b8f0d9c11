"""The optimizers a visit can train its block with: one entry each, which every reader takes from (docs/DESIGN.md §2.3).

    OPTIMIZERS["adamw"].build(params, spec)   # the torch optimizer over the active block (models/trainer.make_optimizer)
    OPTIMIZERS["adamw"].paper_lr              # the learning rate when optim.lr is unset (paper §4.2.1)
    OPTIMIZERS["adamw"].state                 # tensors of state per trainable parameter (the planner, models/memory.py)
    OPTIMIZERS["adamw8bit"].state_bytes(n)    # bytes of that state for an n-element parameter (8-bit: about 2n)

A new optimizer is one entry here: ``core/config.OptimSection.name`` accepts the names of this registry, the trainer
builds it, and the planner counts its state. An entry is data (names, rates, counts, flags): its builder and wrapper
are named by import path and imported when an optimizer is built, so the run config and the commands that only read
a store (``compare`` labels a run that is not full-parameter training) load no torch (``tests/test_config.py``).

The peers (issue 35: ``galore``, ``apollo``, ``apollo-mini``, ``badam``, ``lisa``, ``lora``; models/peers.py) are the
methods a user would otherwise run, each a way to train the whole model in the baseline's step loop (``bcdflow
baseline --set optim.name=galore``): they take the parameters by name, need one block and one process
(``check``), and their packages are the ``peers`` extra. ``lora`` also wraps the model (``wrap``) and is not
full-parameter training.

The lighter states (issue 33: ``adamw8bit``, ``adamw8bit-bf16``; models/light.py) are AdamW for a BCD visit with
8-bit moments (``state_bits``), the second also with bf16 master weights (``master``: 2 bytes a weight matrix and its
gradient, updates rounded stochastically): the same block in less memory, or a larger block in the same. Their
package, bitsandbytes, is the ``light`` extra; a run checks it and the device before it writes anything
(``check``).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import math
from dataclasses import dataclass
from typing import Callable

from bcdflow.models.errors import ConfigError

MIN_8BIT = 4096
"""bitsandbytes' ``min_8bit_size``: a smaller tensor keeps fp32 moments."""
QBLOCK = 256
"""Elements per fp32 scale of bitsandbytes' blockwise 8-bit state."""
LIGHT_CHUNK = 1 << 22
"""Elements of a parameter a lighter state updates at once (16 MB of fp32; a multiple of ``QBLOCK``): the fp32
copies a bf16 weight's update takes are a chunk's (models/light.py)."""
LIGHT_DEVICES = ("cpu", "cuda")
"""The device types bitsandbytes' 8-bit optimizer runs on (its CPU and CUDA kernels)."""


@dataclass(frozen=True)
class Optimizer:
    builder: str
    """``module:function`` of ``build(params, spec) -> torch.optim.Optimizer``: the optimizer over ``params`` with
    ``spec``'s settings (``models/specs.OptimSpec``), imported on first use."""
    paper_lr: float
    """The learning rate of the paper's §4.2.1 when ``optim.lr`` is unset."""
    state: int
    """Parameter-sized tensors of optimizer state per trainable parameter (AdamW's two moments, SGD's momentum
    buffer), each of ``state_bits``."""
    state_bits: int = 32
    """Bits an element of each state tensor: 32 (fp32), or 8 (bitsandbytes' blockwise-quantized moments: one byte an
    element and an fp32 scale per 256 elements; tensors under 4096 elements keep fp32)."""
    master: int = 4
    """Bytes of a trained weight matrix and of its gradient: 4 (fp32 master weights), 2 (bf16 master weights,
    updates rounded stochastically; vectors, norm gains and biases, stay fp32). 2 needs ``train.precision=bf16``."""
    light: bool = False
    """A lighter state of the ``light`` extra (models/light.py): checked before a run writes anything."""
    decay_temporary: bool = False
    """Whether a step with weight decay allocates a gradient-sized temporary (foreach SGD adds the decay to a copy)."""
    peer: bool = False
    """A method of its own for the whole model (``build(named, spec)`` gets ``(name, parameter)`` pairs); trained by
    the baseline's one-block loop, not inside a BCD visit. ``state`` is then the planner's upper bound (AdamW's)."""
    full_parameter: bool = True
    """Whether every parameter of the model can change (LoRA: the adapters only, merged at the end)."""
    wrapper: str | None = None
    """``module:function`` of ``wrap(model, spec) -> (trained named parameters, finish)``: a model wrapper (LoRA's
    adapters); ``finish()`` leaves the model as its own names again, the wrapper merged in, before its block is
    written."""

    def build(self, params, spec):
        """The torch optimizer over ``params`` (its builder imported now)."""
        return _function(self.builder)(params, spec)

    @property
    def wrap(self) -> Callable | None:
        """The model wrapper (imported now), or None."""
        return _function(self.wrapper) if self.wrapper else None

    def state_bytes(self, numel: int) -> int:
        """Bytes of the optimizer state of an ``numel``-element parameter."""
        if self.state_bits == 8 and numel >= MIN_8BIT:
            return self.state * (numel + 4 * -(-numel // QBLOCK))
        return self.state * 4 * numel

    def param_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of a trained parameter of ``shape`` (its gradient takes as many): a matrix at ``master`` bytes an
        element, a vector in fp32."""
        return math.prod(shape) * (self.master if len(shape) >= 2 else 4)

    def check(self, name: str, blocks: int, gpus: int, device: str = "cpu", precision: str = "fp32",
              parallel: str = "auto") -> None:
        """A peer's needs, before a run writes anything: its package (the ``peers`` extra), one block (the
        baseline: ``bcdflow baseline``) and one process. A lighter state's: its package (the ``light`` extra), on
        several processes a replica each (``parallel``: ddp or auto, not fsdp: its state is not sharded), a device
        its library runs on (``device``: the run's device type), bf16 compute for bf16 master weights."""
        if self.light:
            if importlib.util.find_spec("bitsandbytes") is None:
                raise ConfigError(f"optim.name: {name} needs the 'light' extra (bitsandbytes not installed): "
                                  "pip install 'bcdflow[light]' (with -c constraints.txt)")
            if gpus != 1 and parallel == "fsdp":
                raise ConfigError(f"optim.name: {name} keeps its 8-bit state whole on each process (FSDP would shard "
                                  "it): set train.parallel=ddp or auto, or optim.name=adamw")
            if device not in LIGHT_DEVICES:
                raise ConfigError(f"optim.name: {name} runs on {' and '.join(LIGHT_DEVICES)} (bitsandbytes), not "
                                  f"on {device!r}; use optim.name=adamw there")
            if self.master == 2 and precision != "bf16":
                raise ConfigError(f"optim.name: {name} keeps bf16 master weights, which need train.precision=bf16 "
                                  f"(got {precision})")
            return
        if not self.peer:
            return
        from bcdflow.models import peers  # torch: a run that checks is about to train

        peers.require(name)
        if blocks != 1:
            raise ConfigError(f"optim.name: {name} trains the whole model in the baseline's step loop: run it with "
                              f"`bcdflow baseline --set optim.name={name}` (BCD visits train with adamw or sgd)")
        if gpus != 1:
            raise ConfigError(f"train.gpus: optim.name={name} trains in one process (set train.gpus=1)")


@functools.lru_cache(maxsize=None)
def _function(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


_PEERS = "bcdflow.models.peers"
OPTIMIZERS: dict[str, Optimizer] = {
    "adamw": Optimizer("bcdflow.models.trainer:adamw", paper_lr=1e-4, state=2),
    "sgd": Optimizer("bcdflow.models.trainer:sgd", paper_lr=0.1, state=1, decay_temporary=True),
    # the lighter states (models/light.py): AdamW's rate, its moments in 8 bits; the second with bf16 master weights
    "adamw8bit": Optimizer("bcdflow.models.light:adamw8bit", paper_lr=1e-4, state=2, state_bits=8, light=True),
    "adamw8bit-bf16": Optimizer("bcdflow.models.light:adamw8bit", paper_lr=1e-4, state=2, state_bits=8, master=2,
                                light=True),
    # the peers (models/peers.py): paper_lr is the authors' rate where they give one for pre-training (GaLore's and
    # APOLLO's READMEs: 0.01), else AdamW's; LoRA's 10x AdamW's ("LoRA without regret", Schulman et al. 2025)
    "galore": Optimizer(f"{_PEERS}:galore", paper_lr=1e-2, state=2, peer=True),
    "apollo": Optimizer(f"{_PEERS}:apollo", paper_lr=1e-2, state=2, peer=True),
    "apollo-mini": Optimizer(f"{_PEERS}:apollo_mini", paper_lr=1e-2, state=2, peer=True),
    "badam": Optimizer(f"{_PEERS}:badam", paper_lr=1e-4, state=2, peer=True),
    "lisa": Optimizer(f"{_PEERS}:lisa", paper_lr=1e-4, state=2, peer=True),
    "lora": Optimizer("bcdflow.models.trainer:adamw_named", paper_lr=1e-3, state=2, peer=True, full_parameter=False,
                      wrapper=f"{_PEERS}:lora_wrap"),
}
