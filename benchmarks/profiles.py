"""Benchmark sizes: ``full`` (a GPU: the paper's settings where a machine can hold them), ``quick`` (2 CPU
cores, under 10 minutes) and ``tiny`` (the smoke tests: every code path in seconds).

``compute`` sizes the step-level benchmarks (memory, iteration, utilization): a registry model with
overrides, one batch, fp32 as in the paper (A.1); ``steps`` timed round-robin rounds, then more (up to
``max_steps`` and ``budget_s`` seconds) while a configuration's two fastest steps still disagree by 10%.
``flows`` sizes the runs through ``flows.bcd`` (validity, sampling, order, cost): ``--set``-style config
keys shared by every run, per-optimizer learning rates, the full runs' step caps (``full_steps``; they
run to the cap, ``bcd.patience=0``, and the report says whether their validation loss had flattened) and
the BCD runs' cycle caps.

Quick compute model: gpt2-124m at quarter width and vocabulary (12 layers, d=192, V=12576): the same
12 layers and the same layers : tied-head parameter ratio (144 d^2 : V d = 2.2 : 1) as GPT-2 124M, so
the product's parameter-balanced plan cuts it where it cuts GPT-2 124M.
Quick flows model: ``tiny`` at d=64 on 150 kB of the built-in corpus (about 1200 training rows of 32
tokens), so the full AdamW run's validation loss flattens within ~600 steps and one 80-step visit reads
its whole sample (1280 rows > 0.9 x 1200): only then does the sample rate change what a visit trains on
(``core.rules.sample_rows`` takes a prefix of one permutation, paper A.2).

``suite`` sizes ``python -m benchmarks suite`` (benchmarks/suite.py): corpora (name -> bytes, built by
benchmarks/corpora.py), models (name -> ``--set`` list), seeds, ``--set`` lists shared by every run
(``sets``), the full baseline's (``full``) and every BCD run's (``bcd``), and the named BCD settings (name ->
``--set`` list, applied after ``bcd``; data only: add a key here to add a setting). Quick: 6 MB per
corpus at V=2048 and 64-token rows, two 64-wide models of 4 and 8 layers (0.1-0.2 s a step on one CPU thread),
a 600-step baseline (still falling: L* is where it got, not a converged loss) and BCD runs that stop at the
first visit reaching L* (``stop_at_target``), so the suite costs what reaching L* costs; validation on the
first 512 rows of the held-out tail (files are interleaved, so they span many sources). The
``full`` size reuses quick's.

``paper`` is the same for ``python -m benchmarks suite --regime paper``: the paper's protocol (§4.2.3) beside
ours, a small corpus trained for many epochs with L* from the baseline's best validation loss (``target: best``).
"""
from __future__ import annotations

_SUITE_QUICK = {
    "corpora": {"pysrc": 6_000_000, "docs": 6_000_000},
    "models": {"l4-d64": ["model.name=tiny", "model.n_layer=4", "model.d_model=64", "model.n_head=4"],
               "l8-d64": ["model.name=tiny", "model.n_layer=8", "model.d_model=64", "model.n_head=4"],
               # issue 41: shaped like the models users train, its vocabulary matrix 7.7% of the parameters
               # (Llama-3-8B: 13%; l4-d64 at V=2048: ~40%)
               "l8-d128": ["model.name=tiny", "model.n_layer=8", "model.d_model=128", "model.n_head=4",
                           "data.vocab_size=1024"],
               # issue 41: deep enough for the block counts the planner gives at 8B on 16-24 GB (12-16 blocks of
               # one layer or more); its vocabulary matrix 4% of the parameters
               "l16-d128": ["model.name=tiny", "model.n_layer=16", "model.d_model=128", "model.n_head=4",
                            "data.vocab_size=1024"]},
    "seeds": [0, 1, 2],
    "optim": "adamw",
    "sets": ["data.seq_len=64", "data.vocab_size=2048", "train.batch_size=16", "optim.lr=2e-3",
             "train.eval_every=50", "train.eval_rows=512", "bcd.window=10"],
    # the baseline runs to its step cap: its plateau rule off (train.patience=0, the default)
    "full": ["train.steps=600"],
    # BCD stops at the first visit that reaches the baseline's final loss + tol (stop_at_target); 10 cycles is a cap
    "bcd": ["bcd.blocks=3", "bcd.max_steps=80", "bcd.cycles=10", "stop.patience_cycles=0"],
    "stop_at_target": True,
    "settings": {"reset-fixed": ["bcd.budget=fixed", "bcd.moments=reset", "bcd.expand=off"],
                 # adaptive visits are shorter: twice the cycles give it about the same step cap (~2400)
                 "keep-adaptive": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=20", "bcd.expand=off"],
                 # issue 33: the lighter state's block count at about the same state memory (3 blocks x 16 bytes a
                 # parameter ~ 2 x 10: 8-bit moments), and fp32 AdamW at 2 blocks (more memory) as the control
                 "light-b2": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=20", "bcd.expand=off",
                              "bcd.blocks=2", "optim.name=adamw8bit"],
                 "keep-adaptive-b2": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=20", "bcd.expand=off",
                                      "bcd.blocks=2"],
                 # issue 33, item 2: the same 2 layer blocks with the vocabulary matrix in 2 row blocks of its own
                 "rows-b2": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=20", "bcd.expand=off",
                             "bcd.blocks=2", "bcd.vocab_blocks=2"],
                 # landscape expansion (bcd.expand) on top of keep-adaptive: adapters of rank r on the suffix (lora-r16:
                 # the product's defaults since issue 25)
                 "lora-r4": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=20", "bcd.expand=lora",
                             "bcd.expand_rank=4"],
                 "lora-r16": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=20", "bcd.expand=lora",
                              "bcd.expand_rank=16"],
                 "lora-r64": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=20", "bcd.expand=lora",
                              "bcd.expand_rank=64"],
                 "lora-r16-lr-half": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=20", "bcd.expand=lora",
                                      "bcd.expand_rank=16", "bcd.expand_lr=1e-3"],
                 "lora-r4-lr5x": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=20", "bcd.expand=lora",
                                  "bcd.expand_rank=4", "bcd.expand_lr=1e-2"],
                 # issue 41: the suffix's full weights by state-free sign descent (bcd.expand=sign), at the block's
                 # rate and at a quarter of it
                 "sign": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=20", "bcd.expand=sign"],
                 "sign-lr-quarter": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=20", "bcd.expand=sign",
                                     "bcd.expand_lr=5e-4"],
                 # issue 41: the other state-free rule, normalized SGD (an RMS step of bcd.expand_lr), at sign's rates
                 "normalized": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=20", "bcd.expand=normalized"],
                 "normalized-lr-quarter": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=20",
                                           "bcd.expand=normalized", "bcd.expand_lr=5e-4"],
                 # issue 41: the block-count curve on the defaults (lora-r16 is 3 blocks): 2, 4 and 8 (one layer a
                 # block on l8-d128), the cycle cap scaled so each setting gets about the same steps
                 "lora-r16-b2": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=20", "bcd.expand=lora",
                                 "bcd.expand_rank=16", "bcd.blocks=2"],
                 "lora-r16-b4": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=15", "bcd.expand=lora",
                                 "bcd.expand_rank=16", "bcd.blocks=4"],
                 "lora-r16-b8": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=8", "bcd.expand=lora",
                                 "bcd.expand_rank=16", "bcd.blocks=8"],
                 # 12 and 16 blocks on l16-d128 (16: one layer a block), the cap at least the 8-block setting's steps
                 "lora-r16-b12": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=6", "bcd.expand=lora",
                                  "bcd.expand_rank=16", "bcd.blocks=12"],
                 "lora-r16-b16": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=5", "bcd.expand=lora",
                                  "bcd.expand_rank=16", "bcd.blocks=16"],
                 # the 8-bit state every 8B recommendation rests on (adamw8bit: bitsandbytes' blockwise 8-bit
                 # moments, fp32 weights on the CPU) at the defaults' 3 blocks
                 "lora-r16-8bit": ["bcd.budget=adaptive", "bcd.moments=keep", "bcd.cycles=20", "bcd.expand=lora",
                                   "bcd.expand_rank=16", "optim.name=adamw8bit"]},
    "tol": 0.02,
}

# the paper's own protocol (§4.2.3: epochs to the same performance, models trained to convergence), beside ours: a
# small corpus (about 115k training tokens) the baseline reads for ~19 epochs, past its best validation loss; L* =
# that best (the early-stopping point) + tol; BCD stops at the first visit that reaches it
_PAPER_QUICK = {
    **_SUITE_QUICK,
    "corpora": {"docs": 400_000},
    "models": {"l4-d64": _SUITE_QUICK["models"]["l4-d64"]},
    "full": ["train.steps=2000"],
    "target": "best",
}


def _peer_methods(full_steps: int, peer_steps: int, bcd: list[str], lr: float) -> dict:
    """The methods of ``python -m benchmarks peers`` (benchmarks/peers.py): full AdamW (the reference), bcdflow's
    defaults, and each peer as a baseline optimizer (models/peers.py) at its authors' settings, with the source."""
    def peer(optim, label, lr_, source, *extra):
        return {"mode": "full", "optim": optim, "lr": lr_, "label": label, "source": source,
                "sets": [f"optim.name={optim}", f"optim.lr={lr_:g}", f"train.steps={peer_steps}", *extra]}
    return {
        "full": {"mode": "full", "optim": "adamw", "lr": lr, "label": "all parameters, AdamW", "sets":
                 [f"train.steps={full_steps}"], "source": "the suite's baseline (benchmarks/profiles.py)"},
        "bcdflow": {"mode": "bcd", "optim": "adamw", "lr": lr, "label": "one block at a time, all parameters",
                    "sets": bcd, "source": "bcdflow's defaults: adaptive budget, kept moments, bcd.expand=lora rank "
                                           "16; stops at the first visit that reaches L*"},
        "badam": peer("badam", "one block at a time, all parameters", lr,
                      "badam 1.4 BlockOptimizer; README: switch_mode=random, switch_block_every=100 (its example), "
                      "embeddings and head as two more blocks (include_embedding/include_lm_head: a model trained "
                      "from scratch; the package's default leaves them frozen), Adam state reset at each switch; "
                      "the rate of full AdamW (Adam on a block)"),
        "lisa": peer("lisa", "embeddings, head and sampled layers", lr,
                     "written from Pan et al. 2024 (LISA, Algorithm 1) as LMFlow's DynamicLayerActivationCallback; "
                     "every decoder layer's AdamW state dropped at each switch, as LMFlow's LISATrainer; "
                     "LMFlow scripts/run_finetune_with_lisa.sh: 1 activated layer, interval 20 steps; AdamW at full "
                     "AdamW's rate"),
        "galore": peer("galore", "all parameters, low-rank gradients", 1e-2,
                       "galore-torch 1.0 GaLoreAdamW; README/paper: rank d/4 (128 of 512 for LLaMA-60M), "
                       "update_proj_gap 200, scale 0.25, proj_type std, lr 0.01; attention and MLP matrices "
                       "projected, the rest AdamW"),
        "apollo": peer("apollo", "all parameters, channel-wise scaling", 1e-2,
                       "apollo-torch 1.0.3 APOLLOAdamW; README: rank 1/4 of the width (as GaLore), proj random, "
                       "scale_type channel, scale 1, update_proj_gap 200, lr 0.01"),
        "apollo-mini": peer("apollo-mini", "all parameters, tensor-wise scaling", 1e-2,
                            "apollo-torch 1.0.3; README: rank 1, scale_type tensor, scale 128, scale_front (small "
                            "models), update_proj_gap 200, lr 0.01"),
        # a control, not a peer: full AdamW at GaLore's and APOLLO's rate, so their rows can be read apart from it
        "adamw-lr1e-2": {"mode": "full", "optim": "adamw", "lr": 1e-2, "label": "all parameters, AdamW at 0.01 "
                         "(control)", "sets": ["optim.lr=0.01", f"train.steps={peer_steps}"],
                         "source": "full AdamW at the rate the GaLore and APOLLO READMEs give their methods: what the "
                                   "rate alone buys"},
        "lora": peer("lora", "adapters only (not full-parameter)", 10 * lr,
                     "peft 0.21.2 LoraModel, its defaults r=8, lora_alpha=8, dropout 0, on every linear map of the "
                     "decoder layers (QLoRA; 'LoRA without regret', Schulman et al. 2025), the rate 10x full "
                     "AdamW's (the same source); merged at the end"),
    }


_PEERS_QUICK = {
    **_SUITE_QUICK,
    # the suite's two corpora and docsrc, one the defaults were not chosen on (Python sources of other packages)
    "corpora": {"pysrc": 6_000_000, "docs": 6_000_000, "docsrc": 6_000_000},
    "methods": _peer_methods(600, 1200, [*_SUITE_QUICK["bcd"], *_SUITE_QUICK["settings"]["lora-r16"]], 2e-3),
    "time_steps": 3,  # round-robin timed rounds of the step figures (up to twice that while they disagree)
}
_PEERS_PAPER = {**_PEERS_QUICK, "corpora": _PAPER_QUICK["corpora"], "models": _PAPER_QUICK["models"],
                "methods": _peer_methods(2000, 4000, [*_SUITE_QUICK["bcd"], *_SUITE_QUICK["settings"]["lora-r16"]],
                                         2e-3),
                "target": "best"}

# paper §4.2.1: AdamW 1e-4, SGD 0.1 (momentum 0.9, weight decay 1e-5). AdamW at 1e-4 barely moves a
# tiny model in a few hundred steps; the CPU sizes use the demo's 3e-3 for both BCD and full runs.
PROFILES: dict[str, dict] = {
    "full": {
        "compute": {"model": "gpt2-124m", "overrides": {}, "batch_size": 8, "seq_len": 1024,
                    "precision": "fp32", "memory_blocks": [2, 3, 4, 5], "iteration_blocks": [3, 4, 5],
                    "warmup": 3, "steps": 10, "max_steps": 30, "budget_s": 300,
                    "matmul_sizes": [2048, 4096, 8192], "matmul_reps": 5},
        "flows": {"sets": ["model.name=tiny", "data.seq_len=128", "data.vocab_size=2048",
                           "data.builtin_bytes=1500000", "data.val_fraction=0.05", "bcd.blocks=3",
                           "bcd.max_steps=200", "bcd.window=25", "bcd.patience=2", "bcd.min_delta=0.005",
                           "bcd.shard_rows=256", "optim.warmup_steps=20", "train.batch_size=16",
                           "train.steps=6000", "train.eval_every=100", "train.eval_rows=512"],
                  "lr": {"adamw": 3e-3, "sgd": 0.1}, "full_steps": {"adamw": 6000, "sgd": 8000},
                  "bcd_cycles": {"adamw": 20, "sgd": 20},
                  "variant_cycles": 12, "tol": 0.02},
        "suite": _SUITE_QUICK,
        "paper": _PAPER_QUICK,
        "peers": _PEERS_QUICK,
        "peers_paper": _PEERS_PAPER,
    },
    "quick": {
        "compute": {"model": "gpt2-124m", "overrides": {"d_model": 192, "n_head": 3, "vocab_size": 12576},
                    "batch_size": 2, "seq_len": 128, "precision": "fp32", "memory_blocks": [2, 3, 4, 5],
                    "iteration_blocks": [3, 4, 5], "warmup": 1, "steps": 4, "max_steps": 12, "budget_s": 60,
                    "matmul_sizes": [512, 1024], "matmul_reps": 3},
        "flows": {"sets": ["model.name=tiny", "model.d_model=64", "model.n_head=4", "data.seq_len=32",
                           "data.vocab_size=512", "data.builtin_bytes=150000", "data.val_fraction=0.1",
                           "bcd.blocks=3", "bcd.max_steps=80", "bcd.window=20", "bcd.patience=2",
                           "bcd.min_delta=0.01", "bcd.shard_rows=1024", "optim.warmup_steps=10",
                           "train.batch_size=16", "train.eval_every=40",
                           "train.eval_rows=256"],
                  "lr": {"adamw": 3e-3, "sgd": 0.1}, "full_steps": {"adamw": 600, "sgd": 600},
                  "bcd_cycles": {"adamw": 6, "sgd": 4},
                  "variant_cycles": 4, "tol": 0.02},
        "suite": _SUITE_QUICK,
        "paper": _PAPER_QUICK,
        "peers": _PEERS_QUICK,
        "peers_paper": _PEERS_PAPER,
    },
    "tiny": {
        "compute": {"model": "tiny", "overrides": {"d_model": 32, "n_head": 2, "vocab_size": 320},
                    "batch_size": 2, "seq_len": 16, "precision": "fp32", "memory_blocks": [3],
                    "iteration_blocks": [3], "warmup": 0, "steps": 1, "max_steps": 1, "budget_s": 0,
                    "matmul_sizes": [128], "matmul_reps": 1},
        "flows": {"sets": ["model.name=tiny", "model.n_layer=2", "model.d_model=32", "model.n_head=2",
                           "data.seq_len=16", "data.vocab_size=300", "data.builtin_bytes=60000",
                           "bcd.blocks=2", "bcd.max_steps=3", "bcd.window=3", "bcd.patience=0",
                           "bcd.shard_rows=64", "train.batch_size=8",
                           "train.eval_every=3", "train.eval_rows=16"],
                  "lr": {"adamw": 3e-3, "sgd": 0.1}, "full_steps": {"adamw": 6, "sgd": 6},
                  "bcd_cycles": {"adamw": 1, "sgd": 1},
                  "variant_cycles": 1, "tol": 0.02},
        "suite": {"corpora": {"pysrc": 150_000},
                  "models": {"l2": ["model.name=tiny", "model.n_layer=2", "model.d_model=32", "model.n_head=2"]},
                  "seeds": [0], "optim": "adamw",
                  # bcd.blocks for every run: the baseline's config is checked (default 3 blocks) before
                  # full_train makes it one block, and this model has 2 layers. The baseline validates at the
                  # first window end (bcd.window steps) past each multiple of train.eval_every: window 5.
                  "sets": ["data.seq_len=16", "data.vocab_size=300", "train.batch_size=8", "optim.lr=3e-3",
                           "train.eval_every=5", "train.eval_rows=16", "bcd.shard_rows=64", "bcd.blocks=2",
                           "bcd.window=5"],
                  "full": ["train.steps=10", "bcd.patience=0"],
                  "bcd": ["bcd.max_steps=5", "bcd.cycles=1"],
                  "settings": {"fixed": ["bcd.patience=0"], "default": []},
                  "tol": 0.02},
    },
}

PROFILES["tiny"]["paper"] = {**PROFILES["tiny"]["suite"], "target": "best"}  # the smoke test of the paper regime
PROFILES["tiny"]["peers"] = {**PROFILES["tiny"]["suite"], "time_steps": 1,
                             "methods": _peer_methods(10, 10, ["bcd.max_steps=5", "bcd.cycles=2"], 3e-3)}
PROFILES["tiny"]["peers_paper"] = {**PROFILES["tiny"]["peers"], "target": "best"}


def profile(name: str) -> dict:
    return PROFILES[name]
