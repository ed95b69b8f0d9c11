"""Export one version of a run as a standalone model directory (``bcdflow export``, and the MLflow
``model/`` artifact at the end of a run). Two formats:

``bcdflow`` (the default)::

    out_dir/model.safetensors   every block's tensors, merged (metadata: run_id, version)
    out_dir/config.json         run id, version, resolved model config, block plan, dataset id
    out_dir/tokenizer.json      the run's tokenizer, when the dataset has one

``hf``: a directory ``transformers.AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``
load as is::

    out_dir/config.json                        the source checkpoint's (dtype updated), or one written for the
                                               run's family (GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM)
    out_dir/model.safetensors                  HF names and layouts (models/hf_names.py), in the source dtype or --dtype;
      or model-0000k-of-0000M.safetensors      one shard per block, with model.safetensors.index.json, above
                                               ``max_shard_bytes`` (a block at a time in memory)
    out_dir/tokenizer.json, tokenizer_config.json, chat_template.jinja, special_tokens_map.json,
    generation_config.json                     the checkpoint's, kept in the store at init; for a run that did
                                               not start from one, the dataset's tokenizer and a generated config

``bcdflow export`` writes either into a temporary directory beside ``out_dir`` and renames it into place
(``written_whole``), so a failure leaves nothing half-written; an existing file or non-empty directory is refused.
Files and directories get the modes the umask gives; a temporary directory left by an export that was killed is
removed by the next export into the same parent directory.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from contextlib import contextmanager

import psutil
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from bcdflow.errors import BadInput
from bcdflow.models import hf_names as hfmap
from bcdflow.models.build import param_shapes
from bcdflow.models.model_config import ModelConfig
from bcdflow.storage import checkpoints, layout, runs
from bcdflow.storage.lease import machine
from bcdflow.storage.store import Store, file_mode, raise_naming

FORMATS = ("bcdflow", "hf")
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
MAX_SHARD_BYTES = 2 << 30
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json")


def stored_model(store: Store, run_id: str, version: int) -> tuple[dict, ModelConfig, dict]:
    """(the run's config, its model config, manifest ``version``), each checked before anything is read or written:
    the model config must build, and the manifest must hold exactly the blocks of the run's plan, so no export and no
    sample is made of a model with a block missing (damage naming the file: exit 1)."""
    conf = runs.read_config(store, run_id)
    try:
        mcfg = ModelConfig.from_dict(conf["model_resolved"])
        blocks = [int(b["index"]) for b in conf["plan"]["blocks"]]
    except (BadInput, KeyError, TypeError, ValueError) as e:
        raise runs.RunStateError(f"run config {store.url_of(layout.config_key(run_id))} is damaged (its model or plan: "
                                 f"{type(e).__name__}: {str(e)[:200]}); restore the object") from None
    return conf, mcfg, checkpoints.read_manifest(store, run_id, version, blocks=blocks)


def load_block(store: Store, run_id: str, conf: dict, mcfg: ModelConfig, manifest: dict, b: int,
               device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Block ``b``'s tensors of ``manifest`` (checksum verified on load), checked to be exactly the parameters the
    run's plan gives the block, at the model's shapes: a file that reads but holds another model is damage."""
    tensors = checkpoints.load_from_manifest(store, run_id, manifest, [b], device=device)
    block = next(x for x in conf["plan"]["blocks"] if int(x["index"]) == b)
    shapes = param_shapes(mcfg)
    want = set(block.get("params") or [])
    wrong = sorted(set(tensors) ^ want) or [n for n in sorted(want) if tuple(tensors[n].shape) != shapes.get(n)]
    if wrong:
        entry = manifest["blocks"][str(b)]["file"]
        raise checkpoints.CheckpointError(f"block file {store.url_of(layout.run_key(run_id, entry))} (block {b} of "
                                          f"version {manifest['version']}) does not hold the block's tensors as the "
                                          f"run's plan names them ({', '.join(wrong[:3])}...); restore it")
    return tensors


def load_model_state(store: Store, run_id: str, version: int,
                     device: str | torch.device = "cpu") -> tuple[dict, ModelConfig, dict[str, torch.Tensor]]:
    """(config, model config, every tensor of ``version``), checked block by block (``stored_model``, ``load_block``)."""
    conf, mcfg, manifest = stored_model(store, run_id, version)
    tensors: dict[str, torch.Tensor] = {}
    for b in sorted(int(k) for k in manifest["blocks"]):
        tensors.update(load_block(store, run_id, conf, mcfg, manifest, b, device))
    return conf, mcfg, tensors


def export_bytes(store: Store, run_id: str, version: int, fmt: str = "bcdflow", dtype: str | None = None) -> int:
    """About how many bytes an export writes: the version's block files (``bcdflow``), or its parameters in the export
    dtype (``hf``); what ``check_room`` asks of the target's file system before anything is written."""
    conf, mcfg, manifest = stored_model(store, run_id, version)
    if fmt != "hf":
        return sum(e["bytes"] for e in manifest["blocks"].values())
    name = DTYPE_NAMES.get(dtype, dtype) or ((conf.get("hf") or {}).get("dtype") or "float32")
    itemsize = hfmap.DTYPES[name].itemsize if name in hfmap.DTYPES else 4
    return sum(torch.Size(s).numel() for s in param_shapes(mcfg).values()) * itemsize


def check_room(out_dir: str, need: int) -> None:
    """BadInput, before anything is written, when the file system that would hold ``out_dir`` has less room free
    than ``need`` bytes (and a margin of 1%)."""
    at = os.path.abspath(os.path.expanduser(out_dir))
    while not os.path.exists(at):
        at = os.path.dirname(at)
    free = shutil.disk_usage(at).free
    if free < need * 1.01:
        raise BadInput(f"export: {out_dir} needs about {need / 1e6:.1f} MB and {at} has {free / 1e6:.1f} MB free; "
                       "export elsewhere or free space")


def check_outside_store(out_dir: str, store: Store) -> None:
    """BadInput when ``out_dir`` lies inside a local store's folder (as the file system resolves both): an export
    there would put files bcdflow did not make among the run's objects, and ``rm``/``prune`` of a run remove them."""
    if not store.is_local:
        return
    out = os.path.realpath(os.path.abspath(os.path.expanduser(out_dir)))
    root = os.path.realpath(store.root)
    if out == root or out.startswith(root + os.sep):
        raise BadInput(f"export: {out_dir} is inside store {store.url}: export outside the store's folders")


def export_version(store: Store, run_id: str, version: int, out_dir: str) -> int:
    """Write version ``version`` of ``run_id`` to ``out_dir``; returns the number of tensors."""
    cfg, _, tensors = load_model_state(store, run_id, version)
    os.makedirs(out_dir, exist_ok=True)
    with _writing(os.path.join(out_dir, "model.safetensors")) as path:
        _save(tensors, path, metadata={"run_id": run_id, "version": str(version)})
    with _writing(os.path.join(out_dir, "config.json")) as path, open(path, "w") as f:
        json.dump({"run_id": run_id, "version": version, "model": cfg["model_resolved"],
                   "plan": cfg["plan"], "dataset": cfg["dataset"]}, f, indent=2)
    tok = layout.dataset_key(cfg["dataset"], layout.DATASET_TOKENIZER)
    if store.exists(tok):
        data = store.read_bytes(tok)
        with _writing(os.path.join(out_dir, "tokenizer.json")) as path, open(path, "wb") as f:
            f.write(data)
    return len(tensors)


def check_target(out_dir: str) -> str:
    """The absolute export directory: new or empty, never a file or a link (the export is renamed into place, which
    would replace a link, not fill where it leads), in a directory that can be created."""
    out = os.path.abspath(os.path.expanduser(out_dir))
    if os.path.islink(out):
        raise BadInput(f"export: {out_dir} is a symbolic link (to {os.readlink(out)}): give the directory itself")
    if os.path.exists(out) and not os.path.isdir(out):
        raise BadInput(f"export: {out_dir} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):
        raise BadInput(f"export: {out_dir} exists and is not empty (choose a new directory)")
    parent = os.path.dirname(out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise BadInput(f"export: cannot create {os.path.dirname(out)} ({parent} is not a writable directory)")
    return out


def _save(tensors: dict[str, torch.Tensor], path: str, metadata: dict) -> None:
    save_file(tensors, path, metadata=metadata)
    os.chmod(path, file_mode())  # safetensors makes its files 0600: the umask's mode, as the export's other files


@contextmanager
def _writing(path: str):
    """Name ``path`` in an error while it is written (a full disk: safetensors and ``write()`` name no file)."""
    try:
        yield path
    except Exception as e:
        raise_naming(e, path)


@contextmanager
def written_whole(out_dir: str):
    """Yield a temporary directory beside ``out_dir`` and move it into place when the block succeeds, so a
    failure leaves nothing half-written. The directory is made with the umask's mode (mkdtemp's would be 0700, and
    the exported model unreadable to the other users of a shared disk); its name says which process writes it, so
    the next export into the same parent removes those of writers that are gone (an export killed mid-write)."""
    out = check_target(out_dir)
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        _remove_abandoned(parent)
        tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{_writer()}-{uuid.uuid4().hex[:6]}")
        os.mkdir(tmp)
    except OSError as e:
        raise BadInput(f"export: cannot write in {parent} ({e.strerror or e})") from None
    try:
        yield tmp
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        os.replace(tmp, out)
    except OSError as e:  # a full disk: name the file as the user asked for it, not its temporary directory
        if e.errno is None or not str(e.filename or "").startswith(tmp + os.sep):
            raise
        raise OSError(e.errno, e.strerror, os.path.join(out, os.path.relpath(e.filename, tmp))) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# a temporary export directory: .{name}.tmp-{boot id, 8 hex}-{pid namespace}-{pid}-{start, ms}-{random}
_TMP = re.compile(r"^\..+\.tmp-([0-9a-f]{8})-(\d+)-(\d+)-(\d+)-[0-9a-f]{6}$")


def _writer() -> str:
    """This process as a temporary directory's name holds it: enough to tell later, on this machine, that it is gone."""
    m, me = machine(), psutil.Process()
    boot = m.get("boot_id", "0" * 8).replace("-", "")[:8]
    return f"{boot}-{m.get('pid_ns', 0)}-{me.pid}-{int(me.create_time() * 1000)}"


def _remove_abandoned(parent: str) -> None:
    """Remove the temporary export directories in ``parent`` whose writer was a process of this machine (boot id and
    pid namespace) that no longer exists; a live writer's, another machine's and anything else are left alone."""
    mine = _writer().split("-")[:2]
    for name in os.listdir(parent):
        m = _TMP.match(name)
        if not m or list(m.groups()[:2]) != mine or mine[0] == "0" * 8:
            continue
        try:
            alive = int(psutil.Process(int(m[3])).create_time() * 1000) == int(m[4])
        except psutil.Error:
            alive = False
        if not alive:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def export_hf(store: Store, run_id: str, version: int, out_dir: str, dtype: str | None = None,
              max_shard_bytes: int = MAX_SHARD_BYTES) -> int:
    """Write version ``version`` of ``run_id`` as a Hugging Face model directory; returns the tensor count.
    ``dtype``: ``bf16``/``fp16``/``fp32`` (or torch's names); None = the source checkpoint's, fp32 otherwise."""
    conf, mcfg, _ = stored_model(store, run_id, version)
    src = conf.get("hf")
    dtype = DTYPE_NAMES.get(dtype, dtype) or (src["dtype"] if src else "float32")
    if dtype not in hfmap.DTYPES:
        raise BadInput(f"--dtype: unknown dtype {dtype!r} (choose from {', '.join(DTYPE_NAMES)})")
    config, files = _hf_config_and_files(store, run_id, conf, mcfg, dtype)
    os.makedirs(out_dir, exist_ok=True)
    n = _write_weights(store, run_id, version, mcfg, conf["plan"], out_dir, hfmap.DTYPES[dtype], max_shard_bytes)
    with _writing(os.path.join(out_dir, "config.json")) as path, open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    for name, data in files.items():
        with _writing(os.path.join(out_dir, name)) as path, open(path, "wb") as f:
            f.write(data)
    return n


def _write_weights(store: Store, run_id: str, version: int, mcfg: ModelConfig, plan: dict, out: str,
                   dtype: torch.dtype, max_shard_bytes: int) -> int:
    """One model.safetensors, or above ``max_shard_bytes`` one shard per block plus the index."""
    total = sum(torch.Size(s).numel() for s in param_shapes(mcfg).values()) * dtype.itemsize
    blocks = [b["index"] for b in plan["blocks"]]
    conf, _, manifest = stored_model(store, run_id, version)

    def hf_block(b: int) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in load_block(store, run_id, conf, mcfg, manifest, b).items():
            key, t = hfmap.to_hf(mcfg, name, t)
            out[key] = t.to(dtype).contiguous()
        return out

    meta = {"format": "pt"}
    if total <= max_shard_bytes or len(blocks) == 1:
        tensors = {k: v for b in blocks for k, v in hf_block(b).items()}
        with _writing(os.path.join(out, "model.safetensors")) as path:
            _save(tensors, path, metadata=meta)
        return len(tensors)
    weight_map, n = {}, 0
    for k, b in enumerate(blocks):
        shard = f"model-{k + 1:05d}-of-{len(blocks):05d}.safetensors"
        tensors = hf_block(b)
        with _writing(os.path.join(out, shard)) as path:
            _save(tensors, path, metadata=meta)
        weight_map.update({name: shard for name in tensors})
        n += len(tensors)
        del tensors
    with _writing(os.path.join(out, "model.safetensors.index.json")) as path, open(path, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return n


def _hf_config_and_files(store: Store, run_id: str, conf: dict, mcfg: ModelConfig,
                         dtype: str) -> tuple[dict, dict[str, bytes]]:
    """config.json and the tokenizer/generation files of the export."""
    src = conf.get("hf")
    if src:  # the source checkpoint's own files: the model is the same architecture, only trained
        config = json.loads(store.read_bytes(layout.hf_key(run_id, "config.json")))
        config = hfmap.with_defaults_stated(config, mcfg, dtype)  # a null read as a default: that default, written
        for key in ("dtype", "torch_dtype"):
            if key in config or key == "dtype":
                config[key] = dtype
        files = {name: store.read_bytes(layout.hf_key(run_id, name)) for name in _TOKENIZER_FILES
                 if store.exists(layout.hf_key(run_id, name))}
        return config, files
    # a run that started from fresh weights: its family's natural architecture and the dataset's tokenizer
    ds = conf["dataset"]
    meta = store.read_json(layout.dataset_key(ds, layout.DATASET_META))
    tok_json = store.read_bytes(layout.dataset_key(ds, layout.DATASET_TOKENIZER))
    eos = Tokenizer.from_str(tok_json.decode()).id_to_token(meta["eos_id"])
    config = hfmap.config_to_hf(mcfg, hfmap.default_architecture(mcfg), dtype)
    config.update({"bos_token_id": meta["eos_id"], "eos_token_id": meta["eos_id"], "pad_token_id": None})
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eos, "eos_token": eos,
                  "model_max_length": mcfg.n_ctx, "clean_up_tokenization_spaces": False}
    return config, {"tokenizer.json": tok_json, "tokenizer_config.json": json.dumps(tok_config, indent=2).encode()}
