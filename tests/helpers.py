"""What tests share besides fixtures (conftest.py): the tiny run config, a finished run's weights, a priced visit
record, a full disk, a run prepared for a visit and a spy on what a visit loads."""
from __future__ import annotations

import builtins
import errno
import math
import os

import torch

from bcdflow.models.model_config import ModelConfig
from bcdflow.storage import checkpoints, runs
from bcdflow.storage.runs import VisitRecord
from bcdflow.storage.store import Store

# a tiny, fast run: ~400 KB of built-in corpus, 6 layers x 64 wide, a few steps per visit
TINY = [
    "model.name=tiny", "model.d_model=64", "model.n_head=4", "data.seq_len=32", "data.vocab_size=512",
    "data.builtin_bytes=300000", "bcd.blocks=3", "bcd.cycles=1", "bcd.max_steps=6", "bcd.window=3",
    "bcd.patience=0", "bcd.shard_rows=16", "optim.lr=0.003", "train.batch_size=8", "train.steps=6",
    "train.eval_rows=32", "train.eval_every=3",
    "bcd.expand=off",  # the invariant and bitwise tests hold unchanged without it (tests/test_expand.py: on)
]


def finished_weights(store: Store, run_id: str) -> dict[str, torch.Tensor]:
    """Every tensor of a finished run's last version."""
    state = runs.read_state(store, run_id)
    assert state.status == "done", (run_id, state.status)
    return checkpoints.load_blocks(store, run_id, state.version)


def visit_record(sp, cycle, block, *, pre=0.0, train=0.0, ev=0.0, val=5.0, steps=10, seconds=None, **kw) -> VisitRecord:
    """A visit record priced by ``sp`` (a ``spend`` config section) as the visit flow prices it."""
    from bcdflow.core import spend

    seconds = pre + train + ev if seconds is None else seconds
    cost = spend.visit_spend(sp, {"preinfer": pre, "train": train, "eval": ev}, seconds)
    fields = {"version": 1, "step_end": steps, "stopped_by": "max_steps", "rows": 1, "tokens": 1, "first_loss": val,
              "train_loss": val, "val_ppl": math.exp(val), "tokens_per_s": 1.0, **kw}
    return VisitRecord(cycle=cycle, block=block, preinfer_seconds=pre, train_seconds=train, eval_seconds=ev,
                       val_loss=val, steps=steps, seconds=seconds, **{**cost, **fields})


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bitwise equal, tensor by tensor."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def count_params(cfg: ModelConfig) -> int:
    """Parameter count without building the model (tied head counted once): the analytic oracle the tests hold
    the built models and the Hugging Face mapping to."""
    d, f, L = cfg.d_model, cfg.ffn_dim, cfg.n_layer
    kv = cfg.kv_heads * cfg.head_dim
    if cfg.family == "gpt":
        b = 1 if cfg.bias else 0
        layer = (d * 3 * d + b * 3 * d) + (d * d + b * d) + (d * f + b * f) + (f * d + b * d) + 2 * (d + b * d)
        emb = cfg.vocab_size * d + cfg.n_ctx * d
        head = 2 * d if cfg.bias else d
    else:
        layer = d * d + 2 * d * kv + d * d + 3 * d * f + 2 * d
        if cfg.qkv_bias:
            layer += d + 2 * kv
        emb = cfg.vocab_size * d
        head = d
    if not cfg.tied:
        head += cfg.vocab_size * d
    return L * layer + emb + head


class DiskFull:
    """A file opened for writing on a disk that fills up: ``write`` puts half its bytes down, then raises ENOSPC
    (as ``write()`` and ``fsync()`` on a full disk do, naming no file)."""

    def __init__(self, f):
        self.f = f

    def write(self, data) -> int:
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def fill_disk(monkeypatch, module, when=lambda path: True) -> None:
    """Make ``module``'s ``open`` (``bcdflow.storage.store``'s: every local store write) hit a full disk for the
    files ``when(path)`` picks."""
    real = builtins.open

    def full_open(file, mode="r", *a, **k):
        f = real(file, mode, *a, **k)
        return DiskFull(f) if set(mode) & set("wax+") and when(os.fspath(file)) else f

    monkeypatch.setattr(module, "open", full_open, raising=False)


def temporaries(root) -> list[str]:
    """Temporary files of a writer left below ``root`` (``*.tmp-*``, mkstemp's ``.tmp-*``, zarr's ``*.partial``)."""
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root)
                  for n in files + dirs if ".tmp" in n or n.endswith(".partial"))


# -- a run prepared and visited through the plain task functions (no Prefect server) ----------------------------

def new_run(cfg, run_id: str = "r") -> str:
    """Prepare the dataset and create version 0 through the plain task functions; returns the dataset id."""
    from bcdflow.tasks.data import prepare_data
    from bcdflow.tasks.run import init_run

    ds_id = prepare_data.fn(cfg, Store(cfg.store))
    init_run.fn(cfg, run_id, ds_id)
    return ds_id


def do_visit(cfg, run_id: str, ds_id: str, cycle: int, block: int, version: int) -> dict:
    """One visit through the plain task functions: pre-infer (block > 0), train, commit."""
    from bcdflow.core.context import RunContext
    from bcdflow.storage.checkpoints import commit_version
    from bcdflow.tasks.preinfer import plan_shards, preinfer_shard
    from bcdflow.core.rules import VisitSpec
    from bcdflow.tasks.train import train_block

    if RunContext.of(cfg, run_id, ds_id).from_acts(block):  # a block with a prefix (a row block: head rows)
        shards = plan_shards.fn(RunContext.of(cfg, run_id, ds_id), cycle, block)
        assert shards, "a fresh visit has shards to compute"
        for s in shards:
            preinfer_shard.fn(RunContext.of(cfg, run_id, ds_id), cycle, block, version, s)
        assert plan_shards.fn(RunContext.of(cfg, run_id, ds_id), cycle, block) == []  # all complete now
    out = train_block.fn(RunContext.of(cfg, run_id, ds_id), VisitSpec(cycle, block, version))
    commit_version(Store(cfg.store), run_id, version, version + 1,
                   {block if out.stored is None else out.stored: out.block_file})  # a row block: its matrix's block
    return out


class Spy:
    """Records the model ``train_block`` loads and the parameters its optimizer gets (no refactor needed)."""

    def __init__(self, monkeypatch):
        import bcdflow.tasks.engine as engine_mod
        from bcdflow.core.context import RunContext

        self.models, self.opt_params, self.opts = [], [], []
        real_load, real_opt = RunContext.load_part, engine_mod.make_optimizer

        def load_part(*args, **kwargs):
            model = real_load(*args, **kwargs)
            if kwargs.get("head"):  # the visit's model (the pre-inference prefix has no head)
                self.models.append(model)
            return model

        def make_optimizer(params, spec):
            opt = real_opt(params, spec)
            # the engine passes (name, parameter) pairs (a peer finds its blocks by name): the parameters
            self.opt_params.append([p[1] if isinstance(p, tuple) else p for p in params])
            self.opts.append(opt)
            return opt

        monkeypatch.setattr(RunContext, "load_part", load_part)
        monkeypatch.setattr(engine_mod, "make_optimizer", make_optimizer)


class run_log:
    """``with run_log() as lines:`` the messages the Prefect run loggers write meanwhile, at INFO (they do not
    propagate, and conftest.py sets them to WARNING): a flow's log as the UI shows it."""

    def __enter__(self) -> list[str]:
        import logging

        lines: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record):
                lines.append(record.getMessage())

        self.handler = Keep(logging.INFO)
        self.levels = {lg: lg.level for lg in map(logging.getLogger, ("prefect.flow_runs", "prefect.task_runs"))}
        for lg in self.levels:
            lg.addHandler(self.handler)
            lg.setLevel(logging.INFO)
        return lines

    def __exit__(self, *exc) -> None:
        for lg, level in self.levels.items():
            lg.removeHandler(self.handler)
            lg.setLevel(level)
