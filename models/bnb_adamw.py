"""bitsandbytes' AdamW8bit as bcdflow steps it (models/light.py says why and how): updated a chunk at a time, without
its device sync after every parameter, bf16 parameters rounded stochastically from draws seeded by (the run's seed,
the step, the parameter, the chunk), its state in torch's form with an exact step count. Its own module: it
subclasses bitsandbytes' class, so importing it imports bitsandbytes, which ``models/light.adamw8bit`` does only
when a light optimizer is built."""
from __future__ import annotations

import bitsandbytes as bnb
import torch
from bitsandbytes import functional as F

from bcdflow.models.optimizers import LIGHT_CHUNK as CHUNK, QBLOCK
from bcdflow.models.rounding import seeded, stochastic_round


class AdamW8bit(bnb.optim.AdamW8bit):
    """bitsandbytes' AdamW8bit, updated a chunk at a time, bf16 parameters rounded stochastically."""

    def __init__(self, params, *, seed: int = 0, **kw):
        super().__init__(params, **kw)
        self.seed = seed
        self._gen: dict[torch.device, torch.Generator] = {}

    @torch.no_grad()
    def step(self, closure=None):  # bitsandbytes' step without its device sync after every parameter
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.initialized:
            self.check_overrides()
            self.to_gpu()
            self.initialized = True
        for gindex, group in enumerate(self.param_groups):
            for pindex, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if len(self.state[p]) == 0:
                    self.init_state(group, p, gindex, pindex)
                self.update_step(group, p, gindex, pindex)
        return loss

    def state_dict(self):  # torch's form: one flat dict of tensors per parameter (bitsandbytes nests its
        return torch.optim.Optimizer.state_dict(self)  # quantization state, which bcd.moments=keep cannot store)

    def load_state_dict(self, state_dict, move_to_device=True):
        # bitsandbytes casts every floating tensor it does not know to the parameter's dtype, the step count
        # included: under bf16 master weights a kept step of 1001 came back as 1000 (bf16 holds integers
        # exactly only to 256), shifting the bias correction and the rounding's seed. The step is an int here.
        steps = {i: int(s["step"]) for i, s in state_dict["state"].items() if "step" in s}
        super().load_state_dict(state_dict, move_to_device)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, step in steps.items():
            if i < len(params) and params[i] in self.state:
                self.state[params[i]]["step"] = step

    @torch.no_grad()
    def update_step(self, group, p, gindex, pindex):
        state = self.state[p]
        config = self.get_config(gindex, pindex, group)
        state["step"] = int(state["step"]) + 1  # a loaded state_dict's step is a tensor
        step = state["step"]
        beta1, beta2 = config["betas"][0], config["betas"][1]
        flat_p = p.data.view(-1) if p.is_contiguous() else None
        if flat_p is None:
            p.data = p.data.contiguous()
            flat_p = p.data.view(-1)
        flat_g = p.grad.contiguous().view(-1)
        s1, s2 = state["state1"].view(-1), state["state2"].view(-1)
        eight = state["state1"].dtype == torch.uint8
        low = p.dtype == torch.bfloat16
        n = flat_p.numel()
        for c, a in enumerate(range(0, n, CHUNK)):
            b = min(n, a + CHUNK)
            w, g = flat_p[a:b], flat_g[a:b]
            if low:  # the update in fp32, rounded stochastically back
                w, g = w.float(), g.float()
            if eight:
                qa, qb = a // QBLOCK, -(-b // QBLOCK)
                F.optimizer_update_8bit_blockwise(
                    self.optimizer_name, g, w, s1[a:b], s2[a:b], beta1, beta2, 0.0, 0.0, config["eps"], step,
                    config["lr"], state["qmap1"], state["qmap2"], state["absmax1"][qa:qb],
                    state["absmax2"][qa:qb], config["weight_decay"], gnorm_scale=1.0, skip_zeros=False)
            else:
                F.optimizer_update_32bit(
                    self.optimizer_name, g, w, s1[a:b], beta1, config["eps"], step, config["lr"], s2[a:b], beta2,
                    0.0, 0.0, config["weight_decay"], 1.0, None, max_unorm=0.0, skip_zeros=False)
            if low:
                del g
                gen = seeded(self._gen, w.device, (self.seed, step, gindex, pindex, c))
                flat_p[a:b].copy_(stochastic_round(w, gen))
