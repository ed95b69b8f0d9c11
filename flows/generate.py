"""``bcdflow generate RUN "prompt"``: sample text from a stored version of a run, with the run's own tokenizer,
without exporting it first (models/sample.py does the sampling).

    bcdflow generate my-run "def fibonacci(" --max-new-tokens 60 --temperature 0.8 --seed 0
    bcdflow generate my-run "Once upon" --version 3 --temperature 0      # greedy

The weights are the version's block files (checked against their sha256 as every load is), the tokenizer and the
end-of-text id those of the run's token dataset (the checkpoint's own for a run from ``model.from_hf``). The text
goes to stdout; ``--json`` gives the ids too. Nothing is written to the store.
"""
from __future__ import annotations

import json

from bcdflow.errors import BadInput


def add_parser(sub, common, store_opts) -> None:
    sp = sub.add_parser("generate", parents=[common], help="sample text from a version of a run (its tokenizer)")
    store_opts(sp)
    sp.add_argument("prompt", help="the text to continue")
    sp.add_argument("--version", type=int, help="the version to sample from (default: the run's last)")
    sp.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    sp.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    sp.add_argument("--top-k", type=int, default=50, help="sample from the k most likely tokens (default 50)")
    sp.add_argument("--seed", type=int, default=0, help="the sampler's seed (default 0): same seed, same text")
    sp.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    sp.add_argument("--json", action="store_true", help="prompt, text and token ids as JSON")
    sp.set_defaults(fn=cmd_generate)


def check_args(args) -> None:
    """The sampler's settings, checked before anything is read (bad input: exit 2)."""
    if args.max_new_tokens < 1:
        raise BadInput(f"--max-new-tokens: at least 1, got {args.max_new_tokens}")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise BadInput(f"--temperature: a number >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 1:
        raise BadInput(f"--top-k: at least 1, got {args.top_k}")
    if args.seed < 0:
        raise BadInput(f"--seed: a number >= 0, got {args.seed}")
    if not args.prompt:
        raise BadInput("prompt: empty (give the text to continue)")


def generate(store, run_id: str, prompt: str, version: int | None = None, max_new_tokens: int = 64,
             temperature: float = 0.8, top_k: int | None = 50, seed: int = 0, device: str = "cpu") -> dict:
    """Continue ``prompt`` with version ``version`` (default: the last) of ``run_id``; returns the version, the
    text and the ids."""
    import torch
    from tokenizers import Tokenizer

    from bcdflow.core.context import resolve_device
    from bcdflow.models import build_model
    from bcdflow.models.model_config import ModelConfig
    from bcdflow.models.sample import sample
    from bcdflow.storage import checkpoints, layout, runs
    from bcdflow.flows.status import stored_version

    _, version = stored_version(store, run_id, version)
    cfg = runs.read_config(store, run_id)
    dataset = cfg.get("dataset")
    tok_key = layout.dataset_key(dataset, layout.DATASET_TOKENIZER) if dataset else None
    if tok_key is None or not store.exists(tok_key):
        tok_key = layout.hf_key(run_id, "tokenizer.json")
    if not store.exists(tok_key):
        raise checkpoints.CheckpointError(f"run {run_id!r} has no tokenizer in the store ({store.url_of(tok_key)} "
                                          "is missing); restore it")
    tok = Tokenizer.from_str(store.read_bytes(tok_key).decode())
    meta_key = layout.dataset_key(dataset, layout.DATASET_META) if dataset else None
    eos = store.read_json(meta_key).get("eos_id") if meta_key and store.exists(meta_key) else None
    ids = tok.encode(prompt).ids
    if not ids:
        raise BadInput(f"prompt: {prompt!r} encodes to no token with the run's tokenizer")
    try:
        dev = resolve_device(device)
    except BadInput as e:  # it names train.device, the run's key; here the device is the command's
        raise BadInput(str(e).replace("train.device", "--device", 1)) from None
    model = build_model(ModelConfig.from_dict(cfg["model_resolved"]), init=False, device=dev)
    model.load_state_dict(checkpoints.load_blocks(store, run_id, version, device=dev), strict=True)
    gen = torch.Generator().manual_seed(seed)
    out = sample(model, ids, max_new_tokens, temperature, top_k, gen, stop_id=eos, vocab=tok.get_vocab_size())
    text = tok.decode([i for i in out if i != eos])
    return {"run_id": run_id, "version": version, "prompt": prompt, "text": text, "prompt_ids": ids, "ids": out}


def cmd_generate(args) -> int:
    from bcdflow.flows.store_admin import cli_store

    check_args(args)
    out = generate(cli_store(args.store, args, write=False), args.run_id, args.prompt, args.version,
                   args.max_new_tokens, args.temperature, args.top_k, args.seed, args.device)
    print(json.dumps(out, indent=2) if args.json else args.prompt + out["text"])
    return 0
