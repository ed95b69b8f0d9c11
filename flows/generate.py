"""``bcdflow generate RUN "prompt"``: sample text from a stored version of a run, with the run's own tokenizer,
without exporting it first (models/sample.py does the sampling).

    bcdflow generate my-run "def fibonacci(" --max-new-tokens 60 --temperature 0.8 --seed 0
    bcdflow generate my-run "Once upon" --version 3 --temperature 0      # greedy

The weights are the version's block files (checked against their sha256 as every load is, and against the run's
plan: every block present, each holding its own tensors), the tokenizer and the end-of-text id those of the run's
token dataset (the checkpoint's own for a run from ``model.from_hf``). The text goes to stdout as it is sampled;
``--json`` gives the ids too, at the end. Every setting is bounded (``check_args``; ``--max-new-tokens`` by the model's
context too). Nothing is written to the store.
"""
from __future__ import annotations

from bcdflow.errors import BadInput
from bcdflow.tracking.tables import strict_json


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


# a temperature this far from 1 is greedy or uniform sampling in all but name, and below it logits / t overflow
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's range


def check_args(args) -> None:
    """The sampler's settings, checked before anything is read (bad input: exit 2)."""
    if args.max_new_tokens < 1:
        raise BadInput(f"--max-new-tokens: at least 1, got {args.max_new_tokens}")
    t = args.temperature
    if not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
        raise BadInput(f"--temperature: 0 (greedy) or between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}, got {t}")
    if args.top_k < 1:
        raise BadInput(f"--top-k: at least 1, got {args.top_k}")
    if not 0 <= args.seed <= MAX_SEED:
        raise BadInput(f"--seed: a number from 0 to 2**63 - 1, got {args.seed}")
    if not args.prompt:
        raise BadInput("prompt: empty (give the text to continue)")


def generate(store, run_id: str, prompt: str, version: int | None = None, max_new_tokens: int = 64,
             temperature: float = 0.8, top_k: int | None = 50, seed: int = 0, device: str = "cpu",
             on_text=None) -> dict:
    """Continue ``prompt`` with version ``version`` (default: the last) of ``run_id``; returns the version, the
    text and the ids. ``on_text`` is called with each piece of the text as it is sampled (whole characters only)."""
    import torch

    from bcdflow.core.context import resolve_device
    from bcdflow.core.export import load_model_state, stored_model
    from bcdflow.models import build_model
    from bcdflow.models.sample import sample
    from bcdflow.flows.status import stored_version

    _, version = stored_version(store, run_id, version)
    cfg, mcfg, _ = stored_model(store, run_id, version)  # the manifest holds every block of the plan
    if max_new_tokens > mcfg.n_ctx:
        raise BadInput(f"--max-new-tokens: at most the model's context, {mcfg.n_ctx} tokens (got {max_new_tokens})")
    tok, eos = _tokenizer(store, run_id, cfg.get("dataset"))
    ids = tok.encode(prompt).ids
    if not ids:
        raise BadInput(f"prompt: {prompt!r:.80} encodes to no token with the run's tokenizer")
    try:
        dev = resolve_device(device)
    except BadInput as e:  # it names train.device, the run's key; here the device is the command's
        raise BadInput(str(e).replace("train.device", "--device", 1)) from None
    model = build_model(mcfg, init=False, device=dev)
    model.load_state_dict(load_model_state(store, run_id, version, device=dev)[2], strict=True)
    gen = torch.Generator().manual_seed(seed)
    drawn: list[int] = []
    shown = ""

    def show(i: int) -> None:  # the text so far, decoded whole; a character still being spelled waits
        nonlocal shown
        if i != eos:
            drawn.append(i)
        text = tok.decode(drawn)
        if text.startswith(shown) and not text.endswith("\ufffd") and len(text) > len(shown):
            on_text(text[len(shown):])
            shown = text

    out = sample(model, ids, max_new_tokens, temperature, top_k, gen, stop_id=eos, vocab=tok.get_vocab_size(),
                 on_token=show if on_text is not None else None)
    text = tok.decode([i for i in out if i != eos])
    if on_text is not None and text.startswith(shown) and len(text) > len(shown):
        on_text(text[len(shown):])
    return {"run_id": run_id, "version": version, "prompt": prompt, "text": text, "prompt_ids": ids, "ids": out}


def cmd_generate(args) -> int:
    import sys

    from bcdflow.flows.store_admin import cli_store

    check_args(args)
    store = cli_store(args.store, args, write=False)

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    if args.json:
        out = generate(store, args.run_id, args.prompt, args.version, args.max_new_tokens, args.temperature,
                       args.top_k, args.seed, args.device)
        print(strict_json(out))
        return 0
    started = []

    def first(piece: str) -> None:  # the prompt goes out with the first piece: nothing is printed on an error
        if not started:
            started.append(True)
            show(args.prompt)
        show(piece)

    generate(store, args.run_id, args.prompt, args.version, args.max_new_tokens, args.temperature, args.top_k,
             args.seed, args.device, on_text=first)
    if not started:
        show(args.prompt)
    print()
    return 0


def _tokenizer(store, run_id: str, dataset: str | None):
    """The run's tokenizer (its dataset's, else the one its Hugging Face export keeps) and its end-of-text id (None
    where the dataset names none); CheckpointError naming the file where it is missing or damaged."""
    from tokenizers import Tokenizer

    from bcdflow.storage import checkpoints, layout

    tok_key = layout.dataset_key(dataset, layout.DATASET_TOKENIZER) if dataset else None
    if tok_key is None or not store.exists(tok_key):
        tok_key = layout.hf_key(run_id, "tokenizer.json")
    if not store.exists(tok_key):
        raise checkpoints.CheckpointError(f"run {run_id!r} has no tokenizer in the store ({store.url_of(tok_key)} "
                                          "is missing); restore it")
    try:
        tok = Tokenizer.from_str(store.read_bytes(tok_key).decode())
    except Exception as e:  # tokenizers' own error type: the file is not a tokenizer
        raise checkpoints.CheckpointError(f"tokenizer {store.url_of(tok_key)} is damaged ({str(e)[:200]}); restore "
                                          "it") from None
    meta_key = layout.dataset_key(dataset, layout.DATASET_META) if dataset else None
    try:
        meta = store.read_json(meta_key) if meta_key and store.exists(meta_key) else {}
    except ValueError:
        meta = {}
    eos = meta.get("eos_id") if isinstance(meta, dict) and type(meta.get("eos_id")) is int else None
    return tok, eos
