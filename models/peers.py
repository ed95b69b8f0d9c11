"""The methods a user would otherwise run, as optimizers of the baseline's step loop (``bcdflow baseline --set
optim.name=galore``; issue 35): each from its authors' package where one exists, at its authors' settings, and
resumable bitwise from a mid-visit checkpoint (its switching or projection state travels in ``state_dict()``).

    galore       GaLoreAdamW (galore-torch 1.0): the decoder layers' matrices' gradients projected to rank d/4 by
                 SVD every 200 steps, scale 0.25 (the GaLore README); everything else plain AdamW
    apollo       APOLLOAdamW (apollo-torch 1.0.3): channel-wise scaling from a random rank-d/4 projection, gap 200,
                 scale 1 (the APOLLO README)
    apollo-mini  the same at rank 1, tensor-wise, scale 128, ``scale_front`` (the README: for small models)
    badam        BlockOptimizer (badam 1.4): AdamW on one block at a time (a decoder layer; the embeddings and the
                 final norm and head as two more blocks), switched every K steps in a random reshuffled order, the
                 state reset at each switch (the BAdam README)
    lisa         LISA (Pan et al. 2024, Algorithm 1, as LMFlow's DynamicLayerActivationCallback): AdamW; the
                 embeddings, final norm and head always trained, gamma decoder layers sampled every K steps, the
                 others frozen; every layer's AdamW state dropped at each switch (LMFlow's LISATrainer); no
                 maintained package, so it is written here
    lora         LoRA adapters (peft's LoraModel, its defaults r=8, alpha=8) on every linear map of the decoder
                 layers, the base frozen, merged when the visit ends: not full-parameter training

The packages are the ``peers`` extra, imported only when a run asks for one (:func:`require` says which extra is
missing, in one line). Random choices (BAdam's block order, LISA's layers) come from the run's seed
(docs/CONVENTIONS.md 16), so a resumed run draws what an uninterrupted one drew.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import warnings

import numpy as np
import torch

from bcdflow.models.errors import ConfigError
from bcdflow.models.plan import layer_of

EXTRA = "peers"
PACKAGES = {"galore": "galore_torch", "apollo": "apollo_torch", "apollo-mini": "apollo_torch", "badam": "badam",
            "lora": "peft"}
# the authors' settings (cited in docs/results/peers-*/peers.md)
PROJ_GAP = 200  # GaLore and APOLLO: steps between projection updates (both READMEs)
GALORE_SCALE = 0.25  # GaLore README / paper: alpha = 0.25
APOLLO = {"apollo": {"scale_type": "channel", "scale": 1.0, "front": False},  # APOLLO README defaults
          "apollo-mini": {"scale_type": "tensor", "scale": 128.0, "front": True}}  # rank 1; scale_front: small models
BADAM_SWITCH = 100  # BAdam README's example switch_block_every
LISA_SWITCH = 20  # LMFlow scripts/run_finetune_with_lisa.sh: interval 20 (its 1 activated layer: optim.lisa_layers)
LORA_RANK, LORA_ALPHA = 8, 8  # peft LoraConfig defaults


class PeerMissing(ConfigError):
    """A peer method's package is not installed."""


def require(name: str) -> None:
    """Raise :class:`PeerMissing` (one line naming the extra) when ``optim.name=name`` needs a package that is
    not installed; bitsandbytes comes in as galore-torch's and apollo-torch's dependency and is checked with them."""
    pkg = PACKAGES.get(name)
    if pkg is None:
        return
    need = [pkg, "bitsandbytes", "transformers"] if pkg in ("galore_torch", "apollo_torch", "badam") else [pkg]
    missing = [p for p in need if importlib.util.find_spec(p) is None]
    if missing:
        raise PeerMissing(f"optim.name: {name} needs the {EXTRA!r} extra ({', '.join(missing)} not installed): "
                          f"pip install 'bcdflow[{EXTRA}]' (with -c constraints.txt)")


RANKED = {"galore": "projects", "apollo": "projects", "lora": "adapts"}  # the peers that take optim.rank


def check_model(name: str, rank: int | None, lisa_layers: int, n_layer: int,
                shapes: dict[str, tuple[int, ...]]) -> None:
    """A peer's settings against the model it trains, before a run writes anything (they were found by LISA's
    constructor in the first visit, or by the allocator on every attempt): ``optim.lisa_layers`` at most the decoder
    layers (``n_layer``); ``optim.rank`` at most the smallest dimension of the decoder layers' matrices it projects
    (GaLore, APOLLO) or adapts (LoRA): past it the projection or the adapters are no longer low rank, and take more
    memory than the matrix (``shapes``: parameter name -> shape, one decoder layer is enough)."""
    if name == "lisa" and lisa_layers > n_layer:
        raise ConfigError(f"optim.lisa_layers: {lisa_layers} sampled layers, but the model has {n_layer} (at most "
                          f"{n_layer})")
    if rank is None or name not in RANKED:
        return
    mats = {n: s for n, s in shapes.items() if layer_of(n) is not None and len(s) == 2}
    if not mats:
        return
    smallest, shape = min(mats.items(), key=lambda kv: min(kv[1]))
    if rank > min(shape):
        raise ConfigError(f"optim.rank: {rank} is past the matrices {name} {RANKED[name]} (the smallest, {smallest}, "
                          f"is {shape[0]} x {shape[1]}): at most {min(shape)}, a low rank is a fraction of it")


def _adamw_kw(spec) -> dict:
    return {"lr": spec.base_lr, "betas": spec.betas, "eps": spec.eps, "weight_decay": spec.weight_decay}


def _low_rank_split(named) -> tuple[list, list]:
    """(the decoder layers' weight matrices, everything else): GaLore's and APOLLO's target modules are the
    attention and MLP linear maps; embeddings, norms, biases and the head stay plain AdamW (both READMEs)."""
    mats = [p for n, p in named if layer_of(n) is not None and p.dim() == 2]
    ids = {id(p) for p in mats}
    return mats, [p for _, p in named if id(p) not in ids]


def _rank(spec, mats: list) -> int:
    """``optim.rank``, else a quarter of the model width (GaLore's and APOLLO's 1/4 of the hidden size)."""
    return spec.rank or max(1, max(min(p.shape) for p in mats) // 4)


def _groups(named, spec, low_rank: dict) -> list[dict]:
    mats, rest = _low_rank_split(named)
    groups = [{"params": rest}] if rest else []
    if mats:
        groups.append({"params": mats, **low_rank})
    return groups


def _projector_state(opt, pack: bool, make=None) -> None:
    """A projector object in each parameter's state (``state["projector"]``) turned into tensors and numbers
    (``pack``: for ``torch.load(weights_only=True)``) or back (``make(group, state)`` builds an empty one)."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st or "projector" not in st:
                continue
            if not pack and isinstance(st["projector"], dict):
                saved, proj = st["projector"], make(group, st)
                for k, v in saved.items():
                    setattr(proj, k, v)
                st["projector"] = proj


def _packed(sd: dict, fields: tuple[str, ...]) -> dict:
    """``state_dict()`` with each projector as a dict of ``fields`` (a copy: the live state keeps its objects)."""
    state = {}
    for i, st in sd["state"].items():
        if "projector" in st:
            proj = st["projector"]
            st = {**st, "projector": {f: getattr(proj, f) for f in fields}}
        state[i] = st
    return {**sd, "state": state}


def galore(named, spec) -> torch.optim.Optimizer:
    require("galore")
    from galore_torch import GaLoreAdamW

    class GaLore(GaLoreAdamW):
        def state_dict(self):
            return _packed(super().state_dict(), ("ortho_matrix",))

        def load_state_dict(self, sd):
            super().load_state_dict(sd)
            from galore_torch.galore_projector import GaLoreProjector

            _projector_state(self, False, lambda g, st: GaLoreProjector(
                g["rank"], update_proj_gap=g["update_proj_gap"], scale=g["scale"], proj_type=g["proj_type"]))

    mats, _ = _low_rank_split(named)
    groups = _groups(named, spec, {"rank": _rank(spec, mats) if mats else 1, "update_proj_gap": PROJ_GAP,
                                   "scale": GALORE_SCALE, "proj_type": "std"})
    with warnings.catch_warnings():  # "this implementation of AdamW is deprecated": the package's own AdamW
        warnings.simplefilter("ignore", FutureWarning)
        return GaLore(groups, **_adamw_kw(spec), no_deprecation_warning=True)


def apollo(named, spec, mini: bool = False) -> torch.optim.Optimizer:
    name = "apollo-mini" if mini else "apollo"
    require(name)
    from apollo_torch import APOLLOAdamW

    class Apollo(APOLLOAdamW):
        def state_dict(self):
            return _packed(super().state_dict(), ("ortho_matrix", "seed", "svd_count"))

        def load_state_dict(self, sd):
            super().load_state_dict(sd)
            _projector_state(self, False, self._initialize_projector)

    s = APOLLO[name]
    mats, _ = _low_rank_split(named)
    rank = 1 if mini else (_rank(spec, mats) if mats else 1)
    groups = _groups(named, spec, {"rank": rank, "proj": "random", "scale_type": s["scale_type"],
                                   "scale": s["scale"], "update_proj_gap": PROJ_GAP, "proj_type": "std"})
    return Apollo(groups, **_adamw_kw(spec), scale_front=s["front"])


def apollo_mini(named, spec) -> torch.optim.Optimizer:
    """APOLLO-Mini: rank 1, tensor-wise scaling (the README's setting for small models)."""
    return apollo(named, spec, mini=True)


def _perm(seed: int, tag: int, epoch: int, n: int) -> list[int]:
    """The ``epoch``-th random order of ``n`` items, from the run's seed (CONVENTIONS 16)."""
    return np.random.default_rng(np.random.SeedSequence([seed, tag, epoch])).permutation(n).tolist()


def blocks_of(names: list[str]) -> list[list[str]]:
    """BAdam's blocks: one per decoder layer (``h.{i}.``), with the embeddings and the final norm and head as two
    more (``include_embedding``/``include_lm_head``: a model trained from scratch must train them)."""
    layers = sorted({i for n in names if (i := layer_of(n)) is not None})
    top = [n.split(".")[0] + "." if "." in n else n for n in names if layer_of(n) is None]  # a module's prefix
    embed = sorted({t for t in top if t in ("wte.", "wpe.")})
    head = sorted(set(top) - set(embed))
    return [b for b in [embed, *[[f"h.{i}."] for i in layers], head] if b]


def badam(named, spec) -> torch.optim.Optimizer:
    require("badam")
    with contextlib.redirect_stdout(io.StringIO()):  # the package prints its choices
        from badam import BlockOptimizer

    blocks = blocks_of([n for n, _ in named])
    K, seed = spec.switch_every or BADAM_SWITCH, spec.seed

    class BAdam(BlockOptimizer):
        """BAdam's BlockOptimizer, its random reshuffled block order drawn from the run's seed (the package draws
        it from torch's global generator) and its switching state in ``state_dict()``."""

        def __init__(self, *a, **kw):
            self.switches = 0  # blocks activated so far; the active one is number switches - 1
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")  # "BAdam expect model to be loaded in fp16/bf16": fp32 here
                super().__init__(*a, **kw)
            del self.state_dict  # the package binds the base optimizer's: ours adds the switching state

        def block_at(self, i: int) -> int:
            epoch, j = divmod(i, self.block_num)
            return _perm(seed, 0xBAD, epoch, self.block_num)[j]

        def _update_active_block_idx(self):
            self.switches += 1
            self.current_block_idx = self.block_at(self.switches)

        def switch_trainable_params(self, verbose=0):
            super().switch_trainable_params(verbose=0)

        def state_dict(self):
            return {**self.base_optimizer.state_dict(), "badam": {"global_step": self.global_step,
                                                                  "active": self.switches - 1}}

        def load_state_dict(self, sd):
            sd = dict(sd)
            own = sd.pop("badam")
            self.global_step = int(own["global_step"])
            self.switches = int(own["active"])
            self.current_block_idx = self.block_at(self.switches)
            self.switch_trainable_params()  # the saved block active again, its fp32 copy taken from the restored
            self.base_optimizer.load_state_dict(sd)  # weights, then its AdamW state

    base = torch.optim.AdamW([p for _, p in named], **_adamw_kw(spec))
    opt = BAdam(base, list(named), block_prefix_list=blocks, switch_block_every=K, switch_mode="random",
                start_block=_perm(seed, 0xBAD, 0, len(blocks))[0], verbose=0)
    return opt


class LISA(torch.optim.AdamW):
    """Layerwise importance sampling AdamW (Pan et al. 2024, "LISA", Algorithm 1; LMFlow's
    DynamicLayerActivationCallback): every ``switch_every`` steps all decoder layers are frozen and ``layers`` of
    them, drawn uniformly without replacement, unfrozen; the embeddings, final norm and head always train. At each
    switch every decoder layer drops its AdamW state and the sampled ones start afresh, a layer drawn again included,
    as LMFlow's ``LISATrainer`` does (it builds a new optimizer at each switch and carries over only the always-trained
    groups' state); the paper's memory: states of the sampled layers only. The draw of period k is a function of
    (seed, k), so a resumed loop draws what it drew."""

    def __init__(self, named, spec):
        self.layer_params: dict[int, list[torch.nn.Parameter]] = {}
        for n, p in named:
            if (i := layer_of(n)) is not None:
                self.layer_params.setdefault(i, []).append(p)
        self.every, self.gamma, self.seed = spec.switch_every or LISA_SWITCH, spec.lisa_layers, spec.seed
        if self.gamma > len(self.layer_params):
            raise ConfigError(f"optim.lisa_layers: {self.gamma} sampled layers, but the model has "
                              f"{len(self.layer_params)}")
        super().__init__([p for _, p in named], **_adamw_kw(spec), fused=True)
        self.steps = 0
        self.sample(0)

    def period_layers(self, k: int) -> list[int]:
        """The layers period ``k`` trains."""
        order = sorted(self.layer_params)
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0x715A, k]))
        return sorted(order[j] for j in rng.choice(len(order), self.gamma, replace=False))

    def sample(self, k: int) -> None:
        self.active = self.period_layers(k)
        for i, ps in self.layer_params.items():
            for p in ps:
                p.requires_grad_(i in self.active)
                self.state.pop(p, None)
                if i not in self.active:
                    p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        self.steps += 1
        if self.steps % self.every == 0:
            self.sample(self.steps // self.every)
        return loss

    def state_dict(self):
        return {**super().state_dict(), "lisa": {"steps": self.steps}}

    def load_state_dict(self, sd):
        sd = dict(sd)
        self.steps = int(sd.pop("lisa")["steps"])
        self.sample(self.steps // self.every)
        super().load_state_dict(sd)


def lisa(named, spec) -> torch.optim.Optimizer:
    return LISA(named, spec)


def lora_targets(model: torch.nn.Module) -> list[str]:
    """Every linear map of the decoder layers (QLoRA's and "LoRA without regret"'s advice: all of them, the MLP's
    included)."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and layer_of(n + ".") is not None]


def lora_wrap(model: torch.nn.Module, spec):
    """Inject peft's LoRA adapters into ``model`` in place (the base frozen); returns the adapters by name and a
    function that merges them into the base weights and removes them (the model's names are its own again)."""
    require("lora")
    from peft import LoraConfig
    from peft.tuners.lora import LoraModel

    targets = lora_targets(model)
    if not targets:
        raise ConfigError("optim.name: lora found no linear map in the decoder layers to adapt")
    wrapped = LoraModel(model, LoraConfig(r=spec.rank or LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                          target_modules=targets), "default")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return named, wrapped.merge_and_unload
