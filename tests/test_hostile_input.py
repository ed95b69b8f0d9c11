"""Nothing a user or a store hands bcdflow makes it crash, hang, retry the wrong thing or touch another file (issue 26).

One test per class of input through the CLI (or the store API, for names read from the store): the exit, the one
line, that nothing was written; for names in the store, that a file outside it is neither read nor removed; a
corrupt mid-visit checkpoint resumed from the last intact point, bitwise equal to an uninterrupted visit.

Run: python -m pytest -q tests/test_hostile_input.py -m "not slow"
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import stat
import threading

import pytest
import torch
from safetensors.torch import save as st_save

from bcdflow.core import export, stop_signals
from bcdflow.core.context import RunContext
from bcdflow.errors import BadInput, DamagedArtifact
from bcdflow.flows.cli import main
from bcdflow.models import hf_names as hfmap
from bcdflow.storage import activations, checkpoints, layout, overview, trainckpt
from bcdflow.storage.corpus import load_texts
from bcdflow.storage.errors import DataError
from bcdflow.storage.hf_checkpoint import Checkpoint
from bcdflow.storage.lease import Lease, LeaseHeld
from bcdflow.storage.store import Store, sha256_bytes
from bcdflow.tasks.train import train_block
from bcdflow.core.rules import VisitSpec
from tests.hf_checkpoints import TEXT, hf_config, make_checkpoint, make_tokenizer
from tests.test_bad_input import _one_line, _sets
from tests.test_distributed import SGD, block_of, setup_visit


def _files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _refused(capsys, args: list[str], message: str, code: int = 2) -> str:
    """``bcdflow args`` exits ``code`` with one line holding ``message`` and no resume hint."""
    assert main(args) == code
    line = _one_line(capsys)
    assert line.startswith("bcdflow: error: ") and message in line and "resume" not in line, line
    return line


# -- 1. config text: any bytes, one line --------------------------------------------------------------------------

CONFIG_TEXT = {
    "--set value that is not YAML (an alias)": ([], ["data.files=*.txt"], "--set 'data.files=*.txt': the value is "
                                                 "not valid YAML at line 1, column 2"),
    "--set value with an open list": ([], ["bcd.boundaries=[1, 2"], "--set 'bcd.boundaries=[1, 2': the value is not "
                                      "valid YAML"),
    "--set value with a date that does not exist": ([], ["experiment=2024-02-30"], "is not valid YAML: day is out of"),
    "--set value with a key twice": ([], ["spend.prices={a: 1, a: 2}"], "key 'a' appears twice in one mapping"),
    "--set of no key": ([], ["..=3"], "--set '..': not a key"),
    "-c file in UTF-16": ("bcd:\n  blocks: 2\n".encode("utf-16"), [], "is UTF-16 text (it starts with a UTF-16 byte "
                          "order mark); save it as UTF-8"),
    "-c file in Latin-1": ("experiment: caf\xe9\n".encode("latin-1"), [], "is not UTF-8 text (byte 0xe9 at offset 15)"),
    "-c file of binary bytes": (bytes(range(256)) * 4, [], "is not UTF-8 text (byte 0x80 at offset 128)"),
    "-c file with a NUL": (b"bcd:\n  blocks: 2\x00\n", [], "is not valid YAML: unacceptable character #x0000"),
    "-c file nested too deeply": (b"[" * 5000, [], "is not valid YAML: nested too deeply"),
    "-c file with a list as a key": (b"? [a]\n: 1\n", [], "is not valid YAML at line 1, column 3: found unhashable "
                                     "key"),
    "-c file with a Python tag": (b"seed: !!python/object/apply:os.getpid []\n", [], "could not determine a "
                                  "constructor"),
}


@pytest.mark.parametrize("text,sets,message", CONFIG_TEXT.values(), ids=CONFIG_TEXT.keys())
def test_config_text_that_is_not_utf8_yaml_is_one_line_exit_2(tmp_path, capsys, text, sets, message):
    args = ["train", *_sets(), *[a for s in sets for a in ("--set", s)], "--store", str(tmp_path / "store")]
    if text:
        (tmp_path / "run.yaml").write_bytes(text)
        args += ["-c", str(tmp_path / "run.yaml")]
    line = _refused(capsys, args, message)
    assert not text or f"config file '{tmp_path / 'run.yaml'}'" in line
    assert not (tmp_path / "store").exists()


def test_every_key_with_any_yaml_value_is_a_config_error_or_accepted():
    """The whole class: each config key set to each of many hostile values parses or is one BadInput line."""
    from bcdflow.core.config import RunConfig, load_config

    keys = [f"{s}.{k}" if hasattr(f.annotation, "model_fields") else s
            for s, f in RunConfig.model_fields.items()
            for k in (f.annotation.model_fields if hasattr(f.annotation, "model_fields") else [None])]
    values = ["-1", "0", "1e400", ".nan", "x", "[]", "{}", "null", "true", "99999999999999999999999", "[1, [2]]",
              "{a: {b: c}}", "2024-01-01", "'", "!!binary aGk=", "!!set {a}", "[" * 200 + "]" * 200, "\x00", "é: 1"]
    for key, value in itertools.product(keys, values):
        try:
            load_config(sets=[f"{key}={value}", "store=/nonexistent/never"])
        except BadInput as e:
            assert "\n" not in str(e), (key, value, str(e))


# -- 2. a checkpoint's config.json: every field checked before anything is built ----------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny LLaMA checkpoint (llama3 rope scaling, untied) and a corpus for it."""
    root = tmp_path_factory.mktemp("hf")
    ck, _ = make_checkpoint(root / "ck", "llama", make_tokenizer(root / "tok"))
    (root / "corpus.txt").write_text(TEXT)
    return root


def _hf_args(hf_dir, ck, store) -> list[str]:
    sets = [f"model.from_hf={ck}", f"data.files={hf_dir / 'corpus.txt'}", "data.seq_len=16", "bcd.blocks=2",
            "train.batch_size=4", "tracking_uri=none"]
    return ["train", *[a for s in sets for a in ("--set", s)], "--store", str(store)]


def _copy(hf_dir, tmp_path, config: dict | None = None):
    ck = tmp_path / "ck"
    shutil.copytree(hf_dir / "ck", ck)
    if config is not None:
        (ck / "config.json").write_text(json.dumps(config))
    return ck


HF_CONFIGS = {
    "a layer count past any real model": ({"num_hidden_layers": 100_000_000},
                                          "config.json num_hidden_layers=100000000 is beyond any model this trains"),
    "null where a number belongs": ({"vocab_size": None}, "config.json vocab_size must be a positive integer, got "
                                    "None"),
    "a string where an object belongs": ({"rope_parameters": "llama3"}, "config.json rope_parameters must be an "
                                         "object, got 'llama3'"),
    "a string where a number belongs": ({"rms_norm_eps": "1e-6"}, "config.json rms_norm_eps must be a positive "
                                        "number"),
    "a string where a flag belongs": ({"tie_word_embeddings": "false"}, "config.json tie_word_embeddings must be true "
                                      "or false"),
    "an unsupported RoPE scaling": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
                                    "rope scaling type 'yarn' is not supported (supported: default, llama3)"),
    "a llama3 scaling with a null factor": ({"rope_parameters": {"rope_type": "llama3", "factor": None,
                                                                 "low_freq_factor": 1, "high_freq_factor": 4,
                                                                 "original_max_position_embeddings": 16}},
                                            "config.json rope_parameters.factor must be a positive number, got None"),
    "architectures that is an object": ({"architectures": {"LlamaForCausalLM": 1}}, "architecture {'LlamaForCausalLM'"),
}


@pytest.mark.parametrize("over,message", HF_CONFIGS.values(), ids=HF_CONFIGS.keys())
def test_checkpoint_config_json_is_checked_like_model_settings(hf_dir, tmp_path, capsys, over, message):
    config = {**json.loads((hf_dir / "ck" / "config.json").read_text()), **over}
    ck = _copy(hf_dir, tmp_path, config)
    line = _refused(capsys, _hf_args(hf_dir, ck, tmp_path / "store"), message)
    assert line.startswith("bcdflow: error: model.from_hf: ")
    assert not (tmp_path / "store").exists()


def test_every_config_json_field_of_any_type_is_a_config_error_or_accepted():
    """The whole class: every field a family reads, set to each wrong type or range, is one ConfigError line."""
    archs = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
             "qwen2": "Qwen2ForCausalLM"}
    values = [None, "12", [], {}, [1], True, -1, 0, 1.5, 10**12, float("inf"), float("nan")]
    for family, arch in archs.items():
        base = {**json.loads(hf_config(family).to_json_string()), "architectures": [arch]}
        hfmap.config_from_hf(base)
        rope = base.get("rope_parameters") or {}
        cases = [{**base, k: v} for k, v in itertools.product([*base, "rope_scaling", "head_dim", "n_inner",
                                                              "sliding_window", "use_sliding_window"], values)]
        cases += [{**base, "rope_parameters": {**rope, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                               k: v}}
                  for k, v in itertools.product(["factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings", "rope_theta"], values)]
        for d in cases:
            try:
                hfmap.config_from_hf(d)
                hfmap.attention_window(d)
            except BadInput as e:
                assert "\n" not in str(e) and str(e).startswith("model.from_hf: "), str(e)


# -- 3. a weights file that does not read whole -------------------------------------------------------------------

@pytest.mark.parametrize("cut,message", [(-1000, "is cut short (its header describes"),
                                         (+7, "has bytes after its last tensor"),
                                         ("header", "is cut short (its header alone needs")])
def test_a_weights_file_that_does_not_read_whole_is_bad_input_naming_it(hf_dir, tmp_path, capsys, cut, message):
    ck = _copy(hf_dir, tmp_path)
    weights = ck / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:100] if cut == "header" else data[:cut] if cut < 0 else data + b"\0" * cut)
    _refused(capsys, _hf_args(hf_dir, ck, tmp_path / "store"), f"model.from_hf: '{weights}' {message}")
    assert not (tmp_path / "store").exists()


def test_a_weights_file_cut_after_it_was_opened_is_bad_input_naming_it(hf_dir, tmp_path):
    """The file changes under a run after its checks (a copy still in progress): reading it is bad input, which is
    never retried (tasks/retry.py), not a transient fault."""
    ck = Checkpoint.open(str(_copy(hf_dir, tmp_path)))
    weights = os.path.join(ck.dir, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) - 1000)
    with pytest.raises(DataError, match=f"cannot read '{weights}' whole"):
        ck.read(list(ck.weight_map))


def test_a_start_refused_after_the_lease_leaves_no_lease_and_no_resume_line(hf_dir, tmp_path, capsys, monkeypatch,
                                                                            prefect_server):
    """The weights file is cut after the start's checks, between the data and version 0: the run never existed, so
    nothing of it stays in the store (its lease, version-0 files) and no ``bcdflow resume`` line is printed."""
    import datasets as bars

    import bcdflow.flows.bcd as bcd

    ck = _copy(hf_dir, tmp_path)
    real = bcd.prepare_data

    def then_cut(cfg, store):
        out = real(cfg, store)
        os.truncate(ck / "model.safetensors", os.path.getsize(ck / "model.safetensors") - 1000)
        return out

    monkeypatch.setattr(bcd, "prepare_data", then_cut)
    store = tmp_path / "store"
    shown = not bars.are_progress_bars_disabled()  # the CLI turns them off before datasets is imported: too late here
    bars.disable_progress_bars()
    try:
        _refused(capsys, [*_hf_args(hf_dir, ck, store), "--run-id", "r"], "is cut short")
    finally:
        if shown:
            bars.enable_progress_bars()
    assert not (store / "runs" / "r").exists()
    assert _files(store) and all(f.startswith("datasets/") for f in _files(store))  # the shared token dataset only


# -- 4. a store path that can never be a directory ----------------------------------------------------------------

def test_a_store_below_a_regular_file_is_refused_by_the_probe(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    store = tmp_path / "afile" / "sub" / "store"
    _refused(capsys, ["train", *_sets(), "--store", str(store)],
             f"store: {store} cannot be created: {tmp_path / 'afile'} is a file, not a directory")
    assert (tmp_path / "afile").read_text() == "x" and _files(tmp_path) == ["afile"]
    _refused(capsys, ["status", "r", "--store", str(store)], "is a file, not a directory")


# -- 5. names read from the store stay inside it ------------------------------------------------------------------

def _outside_checkpoint(tmp_path):
    """A valid params file and optimizer file outside the store, as a pointer would name them: had bcdflow followed
    the names, it would load them (their checksums match)."""
    pbytes = st_save({"param/w": torch.full((3,), 7.0), "rng/torch": torch.get_rng_state()})
    obytes = (tmp_path / "optim.pt")
    torch.save({"state": {}, "param_groups": []}, obytes)
    (tmp_path / "params.safetensors").write_bytes(pbytes)
    return sha256_bytes(pbytes), sha256_bytes(obytes.read_bytes())


def test_a_checkpoint_pointer_naming_a_file_outside_its_folder_is_neither_read_nor_removed(tmp_path, caplog):
    store = Store(str(tmp_path / "store"))
    vkey = layout.visit_key("r", 0, 1)
    psha, osha = _outside_checkpoint(tmp_path)
    depth = "../" * 6  # from runs/r/visits/c0-b1/train-ckpt/ up to tmp_path
    pointer = {"step": 3, "params": f"{depth}params.safetensors", "params_sha256": psha, "optim": f"{depth}optim.pt",
               "optim_sha256": osha, "meta": {"base_version": 0, "loop": {}}}
    assert os.path.realpath(os.path.join(store.root, layout.train_ckpt_key(vkey), pointer["params"])) == \
        str(tmp_path / "params.safetensors")  # the name does lead there
    store.write_json(pointer, layout.train_ckpt_key(vkey), "ckpt.json")
    before = {p: (tmp_path / p).read_bytes() for p in ("params.safetensors", "optim.pt")}
    with caplog.at_level(logging.WARNING, logger="bcdflow.storage.trainckpt"):
        assert trainckpt.load(store, vkey) is None  # not the outside file's tensors: the visit starts over
    (record,) = [r for r in caplog.records if r.name == "bcdflow.storage.trainckpt"]
    assert "ckpt.json is damaged (it names '../" in record.getMessage() and "resume starts the visit over" in \
        record.getMessage()
    with pytest.raises(trainckpt.TrainCheckpointError, match="not a file of its folder"):
        trainckpt.read_pointer(store, vkey)  # `bcdflow status` says so: exit 1 naming the pointer
    trainckpt.save(store, vkey, 4, {"w": torch.zeros(3)}, {}, {"base_version": 0, "loop": {}})
    assert {p: (tmp_path / p).read_bytes() for p in before} == before  # the next checkpoint removed nothing outside
    assert sorted(store.listdir(layout.train_ckpt_key(vkey))) == ["ckpt.json", "optim-4.pt", "params-4.safetensors"]


@pytest.mark.parametrize("text", ["{not json", '{"meta": "x"}', '{"step": 3, "meta": []}'])
def test_a_damaged_pointer_does_not_stop_the_visit_before_its_loader_and_status_names_it(tmp_path, text):
    """The visit's spend reads the pointer before the checkpoint loader does (storage/overview.visit_spent): a
    damaged one counts as none there (the loader says so in its line and starts the visit over), and `bcdflow
    status` names it as damage (exit 1), through the one torch-free reader (storage/ckpt_pointer.read_pointer)."""
    store = Store(str(tmp_path / "store"))
    vkey = layout.visit_key("r", 0, 1)
    store.write_bytes(text.encode(), layout.train_ckpt_key(vkey), "ckpt.json")
    assert overview.visit_spent(store, "r", 0, 1, 0, None)[0] is None
    with pytest.raises(DamagedArtifact, match="ckpt.json is damaged"):
        overview.training_visit(store, "r")
    assert trainckpt.load(store, vkey) is None


def test_a_manifest_or_record_naming_a_file_outside_the_run_is_damage_naming_it(tmp_path, tiny_cfg, capsys):
    from tests.helpers import new_run

    cfg = tiny_cfg()
    new_run(cfg)
    store = Store(cfg.store)
    outside = tmp_path / "outside.safetensors"
    data = store.read_bytes("runs/r/" + store.read_json("runs/r/versions/0.json")["blocks"]["1"]["file"])
    outside.write_bytes(data)  # a valid block file, checksum and all
    good = store.read_json("runs/r/versions/0.json")
    manifest = json.loads(json.dumps(good))
    manifest["blocks"]["1"] = {"file": "blocks/../../../../outside.safetensors", "sha256": sha256_bytes(data),
                               "bytes": len(data)}
    store.write_json(manifest, "runs/r/versions/0.json")
    with pytest.raises(checkpoints.CheckpointError, match="versions/0.json is damaged .*block 1 names "
                                                          "'blocks/../../../../outside.safetensors'"):
        checkpoints.load_blocks(store, "r", 0)
    with pytest.raises(checkpoints.CheckpointError, match="the run state names"):
        checkpoints.load_file(store, "r", manifest["blocks"]["1"], "the optimizer moments of block 1")
    with pytest.raises(layout.UnsafeName):
        store.read_bytes("runs/r/blocks/../../../outside.safetensors")
    (tmp_path / "out").mkdir()
    line = _refused(capsys, ["export", "r", str(tmp_path / "out" / "m"), "--store", cfg.store],
                    "versions/0.json is damaged (restore it, or export an earlier version", code=1)
    assert "outside.safetensors" in line and outside.read_bytes() == data and not (tmp_path / "out" / "m").exists()
    # the run's config names its dataset: a tokenizer outside the store is not what the export copies
    store.write_json(good, "runs/r/versions/0.json")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "tokenizer.json").write_bytes(store.read_bytes(
        layout.dataset_key(store.read_json("runs/r/config.json")["dataset"], layout.DATASET_TOKENIZER)))
    store.write_json({**store.read_json("runs/r/config.json"), "dataset": "../elsewhere"}, "runs/r/config.json")
    _refused(capsys, ["export", "r", str(tmp_path / "out" / "m"), "--store", cfg.store],
             "config.json is damaged (dataset: '../elsewhere' is not a token dataset id)", code=1)
    assert not (tmp_path / "out" / "m").exists() and os.listdir(tmp_path / "out") == []


# -- 6. a corrupt mid-visit checkpoint: on from the last intact point, bitwise ------------------------------------

LONG = ("bcd.max_steps=40", "checkpoint.every_steps=10", "checkpoint.max_share=1", "checkpoint.every_seconds=1000",
        "bcd.window=10")


@pytest.mark.parametrize("damage", ["latest", "both"])
def test_a_corrupt_checkpoint_resumes_from_the_last_intact_point_bitwise(tiny_cfg, monkeypatch, caplog, damage):
    """A visit interrupted at step 25 (checkpoints at 10, 20 and 25); the latest one corrupt: it goes on from step 20
    (the one kept before it), both corrupt: from its start; either way it ends bitwise where an uninterrupted visit
    ends, and says so in one line."""
    cfg = tiny_cfg(*SGD, *LONG)
    ds = setup_visit(cfg, 1)
    polls = itertools.count(1)
    monkeypatch.setattr(stop_signals, "requested", lambda: next(polls) >= 25)  # a SIGTERM arriving during step 25
    with pytest.raises(SystemExit):
        train_block.fn(RunContext.of(cfg, "r", ds), VisitSpec(0, 1, 0))
    monkeypatch.undo()
    store = Store(cfg.store)
    ckdir = layout.train_ckpt_key(layout.visit_key("r", 0, 1))
    pointer = store.read_json(ckdir, "ckpt.json")
    assert (pointer["step"], pointer["previous"]["step"]) == (25, 20)
    for entry in [pointer, pointer["previous"]][: 2 if damage == "both" else 1]:
        data = bytearray(store.read_bytes(ckdir, entry["params"]))
        data[-3] ^= 0xFF
        store.write_bytes(bytes(data), ckdir, entry["params"])
    with caplog.at_level(logging.WARNING, logger="bcdflow.storage.trainckpt"):
        resumed = train_block.fn(RunContext.of(cfg, "r", ds), VisitSpec(0, 1, 0))
    (record,) = [r for r in caplog.records if r.name == "bcdflow.storage.trainckpt"]
    line = record.getMessage()
    assert "params-25.safetensors is corrupt (sha256 mismatch)" in line and "\n" not in line
    assert ("goes on from its checkpoint of step 20" if damage == "latest" else "the visit starts over") in line
    assert resumed.resumed_at == (20 if damage == "latest" else 0) and resumed.steps == 40
    store.rm(ckdir)
    ref = train_block.fn(RunContext.of(cfg, "r", ds), VisitSpec(0, 1, 0))
    a, b = block_of(cfg, 1, ref.block_file), block_of(cfg, 1, resumed.block_file)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("sets", [(), ("optim.name=adamw8bit-bf16", "train.precision=bf16")],
                         ids=["adamw", "adamw8bit-bf16"])
def test_a_resumed_visit_holds_no_copy_of_its_checkpoint_while_it_trains(tiny_cfg, monkeypatch, sets):
    """Issue 43: a resumed visit kept the checkpoint's tensors (loaded onto its device) bound for its whole loop, a
    second copy of the block, and of its optimizer state where the optimizer copies what it loads (bitsandbytes deep-
    copies), which no plan counts: a preempted visit on a tightly planned card could run out after resume. Once the
    loop starts, no loaded tensor is alive but those the optimizer holds as its own state."""
    import gc
    import weakref

    import bcdflow.tasks.engine as engine

    cfg = tiny_cfg(*LONG, *sets)
    ds = setup_visit(cfg, 1)
    polls = itertools.count(1)
    monkeypatch.setattr(stop_signals, "requested", lambda: next(polls) >= 15)  # a SIGTERM during step 15
    with pytest.raises(SystemExit):
        train_block.fn(RunContext.of(cfg, "r", ds), VisitSpec(0, 1, 0))
    monkeypatch.undo()
    loaded, real_load, real_run, leaked = [], trainckpt.load, engine.run_steps, []

    def load(*a, **k):
        ck = real_load(*a, **k)
        if ck is not None:
            _, params, opt_state = ck
            loaded.extend(weakref.ref(t) for t in params.values())
            loaded.extend(weakref.ref(t) for st in opt_state["state"].values() for t in st.values()
                          if isinstance(t, torch.Tensor))
        return ck

    def run_steps(loss, params, batches, opt, *a, **k):
        gc.collect()
        own = {id(t) for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)}
        leaked.append([tuple(t.shape) for r in loaded if (t := r()) is not None and id(t) not in own])
        return real_run(loss, params, batches, opt, *a, **k)

    monkeypatch.setattr(trainckpt, "load", load)
    monkeypatch.setattr(engine, "run_steps", run_steps)
    resumed = train_block.fn(RunContext.of(cfg, "r", ds), VisitSpec(0, 1, 0))
    assert resumed.resumed_at == 15 and resumed.steps == 40 and len(loaded) > 2
    assert leaked == [[]]


def test_a_checkpoint_carries_the_cuda_rng_of_the_runs_device_by_index(tmp_path, monkeypatch):
    """The CUDA RNG a mid-visit checkpoint saves and restores is the run's device's (``cuda:1`` on a box whose
    current device is 0), never the current one's, and ``cuda`` without an index is the current index (torch names
    devices so). torch's CUDA RNG calls are recorded, not run: this machine has no GPU (tests/test_gpu.py runs it
    on one). A run on the CPU carries none."""
    calls = []
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        lambda device="cuda": calls.append(("get", str(device))) or torch.zeros(16, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": calls.append(("set", str(device))))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    store, vkey = Store(str(tmp_path / "store")), layout.visit_key("r", 0, 1)
    meta = {"base_version": 0, "loop": {}}
    trainckpt.save(store, vkey, 1, {"w": torch.zeros(2)}, {}, meta, rng_device="cuda:1")
    assert trainckpt.load(store, vkey, rng_device=torch.device("cuda", 1)) is not None
    trainckpt.save(store, vkey, 2, {"w": torch.zeros(2)}, {}, meta, rng_device="cuda")
    assert trainckpt.load(store, vkey, rng_device="cuda") is not None
    assert calls == [("get", "cuda:1"), ("set", "cuda:1"), ("get", "cuda:0"), ("set", "cuda:0")]
    trainckpt.save(store, vkey, 3, {"w": torch.zeros(2)}, {}, meta, rng_device="cpu")
    assert trainckpt.load(store, vkey, rng_device="cpu") is not None and len(calls) == 4


# -- 7. files and directories as the umask says; an interrupted export's leftovers cleaned ------------------------

@pytest.fixture
def umask_027():
    old = os.umask(0o027)  # not the usual 022: modes that come out right by accident would not
    yield
    os.umask(old)


def _modes(root) -> set[tuple[bool, int]]:
    return {(os.path.isdir(p), stat.S_IMODE(os.stat(p).st_mode))
            for d, dirs, files in os.walk(root) for p in [d, *(os.path.join(d, n) for n in dirs + files)]}


def test_written_files_and_directories_honour_the_umask(tiny_cfg, tmp_path, monkeypatch, umask_027):
    """Everything bcdflow writes (the dataset, block files, activations, mid-visit checkpoints, an exported model)
    gets the umask's modes: block files and exports came out 0600 and 0700 (a library's temporary files)."""
    cfg = tiny_cfg(*SGD, "bcd.max_steps=8", "checkpoint.every_steps=2", "checkpoint.max_share=1")
    ds = setup_visit(cfg, 1)
    monkeypatch.setattr(stop_signals, "requested", lambda: True)  # a SIGTERM at the first step: its checkpoint
    with pytest.raises(SystemExit):
        train_block.fn(RunContext.of(cfg, "r", ds), VisitSpec(0, 1, 0))
    monkeypatch.undo()
    assert (tmp_path / "store" / "runs" / "r" / "visits" / "c0-b1" / "train-ckpt" / "ckpt.json").exists()
    assert _modes(tmp_path / "store") == {(True, 0o750), (False, 0o640)}
    out = tmp_path / "exported" / "model"
    for fmt in ("bcdflow", "hf"):
        assert main(["export", "r", str(out / fmt), "--format", fmt, "--store", cfg.store]) == 0
    assert _modes(tmp_path / "exported") == {(True, 0o750), (False, 0o640)}


def test_an_interrupted_exports_temporary_directory_is_removed_by_the_next_export(tiny_cfg, tmp_path):
    from tests.helpers import new_run

    cfg = tiny_cfg()
    new_run(cfg)
    parent = tmp_path / "exported"
    parent.mkdir()
    boot, ns, pid, started = export._writer().split("-")
    dead = parent / f".old.tmp-{boot}-{ns}-{2 ** 22 + 7}-{started}-abcdef"  # a pid no process has
    live = parent / f".busy.tmp-{boot}-{ns}-{pid}-{started}-abcdef"  # this process: an export in progress
    elsewhere = parent / f".far.tmp-00000001-{ns}-{2 ** 22 + 7}-{started}-abcdef"  # another machine's
    for d in (dead, live, elsewhere):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    (parent / "notes.tmp-1").write_text("not ours")
    assert main(["export", "r", str(parent / "m"), "--store", cfg.store]) == 0
    assert sorted(os.listdir(parent)) == sorted([live.name, elsewhere.name, "m", "notes.tmp-1"])


# -- 8. smaller ----------------------------------------------------------------------------------------------------

def test_a_cut_jsonl_is_one_data_error_without_datasets_log_lines(tmp_path, caplog):
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": f"row {i} " * 20}) + "\n" for i in range(20)) + '{"text": "cut he')
    with caplog.at_level(logging.DEBUG), pytest.raises(DataError, match="data.files: cannot read json file"):
        load_texts([str(f)], cache_dir=str(tmp_path / "cache"))
    assert not [r for r in caplog.records if r.name.startswith("datasets") and r.levelno >= logging.WARNING]


def test_a_second_taker_of_a_live_lease_on_this_machine_stops_at_once(tmp_path):
    """A live holder here renews every ttl/3 (200 s at ttl 600): the second process must not wait for a renewal."""
    store = Store(str(tmp_path / "store"))
    holder = Lease(store, "runs/r", "run 'r'", ttl=600)
    out: list = []
    with holder.held():
        t = threading.Thread(target=lambda: out.append(_acquire(Lease(store, "runs/r", "run 'r'", ttl=600))),
                             daemon=True)
        t.start()
        t.join(timeout=30)
        assert not t.is_alive() and isinstance(out[0], LeaseHeld) and "run 'r' is in use by" in str(out[0])


def _acquire(lease: Lease):
    try:
        return lease.acquire()
    except LeaseHeld as e:
        return e


def test_a_shard_that_fails_its_checksum_is_logged_when_it_is_recomputed(tmp_path, caplog):
    store = Store(str(tmp_path / "store"))
    key = "runs/r/visits/c0-b1/activations.zarr"
    activations.create_group(store, key, n_rows=8, seq_len=4, d_model=3, shard_rows=4)
    for s in range(2):
        activations.write_shard(store, key, s, torch.randn(4, 4, 3), torch.zeros(4, 4, dtype=torch.int32))
    chunk = tmp_path / "store" / key / "hidden" / "c" / "1" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="bcdflow.storage.activations"):
        assert [s for s in range(2) if not activations.shard_complete(store, key, s)] == [1]
    (record,) = [r for r in caplog.records if r.name == "bcdflow.storage.activations"]
    assert "shard 1 of" in record.getMessage() and "is corrupt" in record.getMessage() and \
        "computed again" in record.getMessage()
    store.write_bytes(b"{not json", layout.shard_done_key(key, 0))  # a damaged marker: recomputed too, no crash
    assert not activations.shard_complete(store, key, 0)

