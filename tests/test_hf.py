"""Hugging Face checkpoints in and out (models/hf_names.py, storage/hf_checkpoint.py, core/hf_import.py, core/export.py): for each family a
tiny random checkpoint made here with transformers is converted into a run's version 0, gives transformers'
logits, and exports back bitwise; bad checkpoints are refused with one line before anything is written; the
slow test fine-tunes one through the CLI on prompt/completion data and loads the result in transformers.

Run: python -m pytest -q tests/test_hf.py -m "not slow"   (CPU, ~30 s; the slow end-to-end test ~1 min)
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from bcdflow.core.config import load_config
from bcdflow.core.context import RunContext, model_config, open_store
from bcdflow.core.export import export_hf, written_whole
from bcdflow.flows.cli import main
from bcdflow.models import hf_names as hfmap
from bcdflow.models.errors import ConfigError
from bcdflow.storage import checkpoints, runs
from bcdflow.storage.errors import DataError
from bcdflow.storage.hf_checkpoint import Checkpoint
from bcdflow.tasks.data import prepare_data
from bcdflow.tasks.run import init_run
from tests.hf_checkpoints import FAMILIES, ROWS, TEXT, VOCAB, load_clean, make_checkpoint, make_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(TEXT)
    return str(path)


def run_cfg(tmp_path, ck: str, corpus: str, *sets: str):
    return load_config(sets=[f"model.from_hf={ck}", f"data.files={corpus}", "data.seq_len=16", "bcd.blocks=2",
                             "train.batch_size=4", f"store={tmp_path / 'store'}", "tracking_uri=none", *sets])


def start_run(cfg, run_id: str = "r"):
    """prepare data + version 0, as a flow does; returns the run context."""
    ds = prepare_data.fn(cfg, open_store(cfg))
    init_run.fn(cfg, run_id, ds)
    return RunContext.of(cfg, run_id, ds)


def hf_tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


# -- in and out, per family ------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_in_logits_and_bitwise_out(tmp_path, tok_dir, corpus, family):
    ck, hf = make_checkpoint(tmp_path / "ck", family, tok_dir)
    ctx = start_run(run_cfg(tmp_path, ck, corpus))
    assert ctx.model_cfg.vocab_size == ROWS  # the embedding rows, not the tokenizer's 300 ids
    ours = ctx.load_part(ctx.manifest(0), (0, ctx.model_cfg.n_layer), embed=True, head=True).eval()
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(idx) - hf(idx).logits).abs().max().item()
    assert diff <= 1e-5, f"{family}: max abs logit difference {diff}"

    out = tmp_path / "out"
    export_hf(ctx.store, "r", 0, str(out))
    src, back = hf_tensors(ck), hf_tensors(out)
    assert set(back) == set(src)  # no lm_head for a tied model, no buffers
    assert all(back[k].dtype == src[k].dtype and torch.equal(back[k], src[k]) for k in src)
    model, tok = load_clean(out)
    assert type(model).__name__ == type(hf).__name__
    assert tok("the quick brown fox")["input_ids"] == ctx.dataset.tokenizer().encode("the quick brown fox").ids
    with torch.no_grad():
        assert torch.equal(model(idx).logits, hf(idx).logits)


def test_bf16_checkpoint_stays_bf16_and_exports_as_fp32_on_request(tmp_path, tok_dir, corpus):
    ck, hf = make_checkpoint(tmp_path / "ck", "llama", tok_dir, dtype=torch.bfloat16)
    ctx = start_run(run_cfg(tmp_path, ck, corpus))
    assert runs.read_config(ctx.store, "r")["hf"]["dtype"] == "bfloat16"
    stored = checkpoints.load_blocks(ctx.store, "r", 0)
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}  # version 0 keeps the checkpoint's bytes
    export_hf(ctx.store, "r", 0, str(tmp_path / "bf16"))
    export_hf(ctx.store, "r", 0, str(tmp_path / "fp32"), dtype="fp32")
    src, bf16, fp32 = hf_tensors(ck), hf_tensors(tmp_path / "bf16"), hf_tensors(tmp_path / "fp32")
    assert all(torch.equal(bf16[k], src[k]) and bf16[k].dtype == torch.bfloat16 for k in src)
    assert all(fp32[k].dtype == torch.float32 and torch.equal(fp32[k], src[k].float()) for k in src)
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"
    model, _ = load_clean(tmp_path / "bf16")
    assert model.dtype == torch.bfloat16


def test_sharded_checkpoint_in_and_sharded_export_out(tmp_path, tok_dir, corpus, monkeypatch):
    ck, hf = make_checkpoint(tmp_path / "ck", "llama", tok_dir, max_shard_size="20KB")
    assert os.path.exists(os.path.join(ck, "model.safetensors.index.json"))
    reads: list[list[str]] = []
    real_read = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, names: reads.append(list(names)) or real_read(self, names))
    ctx = start_run(run_cfg(tmp_path, ck, corpus))
    # lazy by block: each read names exactly one block's tensors
    plan = ctx.plan
    assert [sorted(r) for r in reads] == [sorted(hfmap.hf_name(ctx.model_cfg, n) for n in b.params) for b in plan.blocks]
    export_hf(ctx.store, "r", 0, str(tmp_path / "out"), max_shard_bytes=1)  # one shard per block
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(plan.blocks)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in hf_tensors(ck).values())
    src, back = hf_tensors(ck), hf_tensors(tmp_path / "out")
    assert set(back) == set(src) and all(torch.equal(back[k], src[k]) for k in src)
    load_clean(tmp_path / "out")


@pytest.mark.parametrize("family", ["tiny", "tiny-llama"])
def test_run_from_fresh_weights_exports_as_its_family(tmp_path, tiny_cfg, family):
    """A run that did not start from a checkpoint exports as GPT2LMHeadModel / LlamaForCausalLM with the
    dataset's tokenizer, and transformers computes the same logits."""
    cfg = tiny_cfg(f"model.name={family}", "data.builtin_bytes=60000", "data.vocab_size=300", "bcd.blocks=2")
    ds = prepare_data.fn(cfg, open_store(cfg))
    init_run.fn(cfg, "n", ds)
    ctx = RunContext.of(cfg, "n", ds)
    ours = ctx.load_part(ctx.manifest(0), (0, ctx.model_cfg.n_layer), embed=True, head=True).eval()
    export_hf(ctx.store, "n", 0, str(tmp_path / "out"))
    model, tok = load_clean(tmp_path / "out")
    assert type(model).__name__ == hfmap.default_architecture(ctx.model_cfg)
    assert hfmap.config_from_hf(json.loads((tmp_path / "out" / "config.json").read_text())).n_ctx == ctx.model_cfg.n_ctx
    idx = torch.from_numpy(ctx.dataset.val_rows()[:2, :16]).long()
    with torch.no_grad():
        assert (model(idx).logits - ours(idx)).abs().max().item() <= 1e-5
    assert tok.decode(idx[0].tolist()) == ctx.dataset.tokenizer().decode(idx[0].tolist())


def test_export_refuses_a_non_empty_directory_and_leaves_nothing_behind(tmp_path, tok_dir, corpus):
    ck, _ = make_checkpoint(tmp_path / "ck", "gpt2", tok_dir)
    ctx = start_run(run_cfg(tmp_path, ck, corpus))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(Exception, match="exists and is not empty"):
        with written_whole(str(tmp_path / "full")) as tmp:
            export_hf(ctx.store, "r", 0, tmp)
    assert os.listdir(tmp_path / "full") == ["keep.txt"]
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


# -- identity ----------------------------------------------------------------------------------------------------
def test_resume_refuses_a_changed_checkpoint(tmp_path, tok_dir, corpus):
    ck, _ = make_checkpoint(tmp_path / "ck", "llama", tok_dir)
    cfg = run_cfg(tmp_path, ck, corpus)
    ctx = start_run(cfg)
    init_run.fn(cfg, "r", ctx.dataset_id)  # same checkpoint: resumes
    make_checkpoint(tmp_path / "ck", "llama", tok_dir, seed=1)  # same path, other weights
    with pytest.raises(ConfigError, match=r"^model\.from_hf: the checkpoint .* changed"):
        init_run.fn(cfg, "r", ctx.dataset_id)


def test_hub_id_only_from_the_local_cache(tmp_path, tok_dir, corpus):
    from huggingface_hub import constants

    repo = f"bcdflow-test/tiny-{os.getpid()}"
    base = os.path.join(constants.HF_HUB_CACHE, "models--" + repo.replace("/", "--"))
    commit = "0" * 40
    make_checkpoint(os.path.join(base, "snapshots", commit), "gpt2", tok_dir)
    os.makedirs(os.path.join(base, "refs"), exist_ok=True)
    with open(os.path.join(base, "refs", "main"), "w") as f:
        f.write(commit)
    try:
        assert model_config(run_cfg(tmp_path, repo, corpus)).family == "gpt"
    finally:
        shutil.rmtree(base)
    with pytest.raises(ConfigError, match=r"^model\.from_hf: .* neither a local directory nor in the local Hugging"):
        model_config(run_cfg(tmp_path, "bcdflow-test/not-cached", corpus))


# -- bad input ------------------------------------------------------------------------------------------------
def _cli_bad(tmp_path, capsys, ck: str, corpus: str, *sets: str) -> str:
    capsys.readouterr()  # whatever making the checkpoint printed
    args = ["train", "--store", str(tmp_path / "store")]
    for s in [f"model.from_hf={ck}", f"data.files={corpus}", "data.seq_len=16", "bcd.blocks=2", "tracking_uri=none",
              *sets]:
        args += ["--set", s]
    rc = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert not os.path.exists(tmp_path / "store")
    return err[0]


def test_directory_without_config_json(tmp_path, capsys, tok_dir, corpus):
    ck, _ = make_checkpoint(tmp_path / "ck", "llama", tok_dir)
    os.remove(os.path.join(ck, "config.json"))
    assert "model.from_hf" in (msg := _cli_bad(tmp_path, capsys, ck, corpus)) and "config.json" in msg


def test_unsupported_architecture_names_it_and_the_supported_list(tmp_path, capsys, tok_dir, corpus):
    ck, _ = make_checkpoint(tmp_path / "ck", "llama", tok_dir)
    conf = json.load(open(os.path.join(ck, "config.json")))
    json.dump({**conf, "architectures": ["FalconForCausalLM"]}, open(os.path.join(ck, "config.json"), "w"))
    msg = _cli_bad(tmp_path, capsys, ck, corpus)
    assert "'FalconForCausalLM' is not supported" in msg
    assert all(a in msg for a in hfmap.architectures())


def test_shard_listed_in_the_index_but_missing(tmp_path, capsys, tok_dir, corpus):
    ck, _ = make_checkpoint(tmp_path / "ck", "llama", tok_dir, max_shard_size="20KB")
    shard = sorted(f for f in os.listdir(ck) if f.startswith("model-"))[1]
    os.remove(os.path.join(ck, shard))
    msg = _cli_bad(tmp_path, capsys, ck, corpus)
    assert "model.from_hf" in msg and shard in msg and "missing" in msg


def test_missing_tensor(tmp_path, capsys, tok_dir, corpus):
    ck, _ = make_checkpoint(tmp_path / "ck", "llama", tok_dir)
    tensors = load_file(os.path.join(ck, "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, os.path.join(ck, "model.safetensors"))
    msg = _cli_bad(tmp_path, capsys, ck, corpus)
    assert "'model.norm.weight'" in msg and "missing" in msg


def test_tokenizer_ids_beyond_the_embedding_rows(tmp_path, capsys, tok_dir, corpus):
    """Fewer embedding rows than tokenizer ids would index past the table: refused. (More rows than ids, as
    here in every other test with 320 rows for 300 ids, is the usual padding and is accepted.)"""
    ck, _ = make_checkpoint(tmp_path / "ck", "llama", tok_dir, rows=VOCAB - 20)
    msg = _cli_bad(tmp_path, capsys, ck, corpus)
    assert "tokenizer.json" in msg and f"only {VOCAB - 20} rows" in msg


@pytest.mark.parametrize("over,sets,key", [
    ({"sliding_window": 8}, [], "data.seq_len"),                    # Mistral window shorter than the rows
    ({"max_position_embeddings": 12}, [], "data.seq_len"),          # beyond the model's context
    ({}, ["model.n_layer=2"], "model.n_layer"),                     # sizes come from config.json
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                          "original_max_position_embeddings": 32}}, [], "model.from_hf"),
    ({"hidden_act": "gelu"}, [], "model.from_hf"),
])
def test_config_json_checked_against_the_run_config(tmp_path, tok_dir, corpus, over, sets, key):
    ck, _ = make_checkpoint(tmp_path / "ck", "mistral", tok_dir, **over)
    with pytest.raises(ConfigError) as e:
        model_config(run_cfg(tmp_path, ck, corpus, *sets))
    assert str(e.value).startswith(f"{key}:") and "\n" not in str(e.value), str(e.value)


def test_chat_needs_a_template_and_a_checkpoint(tmp_path, tok_dir, corpus):
    ck, _ = make_checkpoint(tmp_path / "ck", "qwen2", tok_dir)
    os.remove(os.path.join(ck, "chat_template.jinja"))
    from bcdflow.core.hf_import import check_checkpoint

    with pytest.raises(DataError, match=r"^data\.format: chat needs a chat template"):
        check_checkpoint(run_cfg(tmp_path, ck, corpus, "data.format=chat"))
    with pytest.raises(ConfigError, match=r"^data\.format: chat needs model\.from_hf"):
        load_config(sets=["data.format=chat"])


def test_mapping_tables_are_inverse_and_cover_every_parameter():
    for family in ("tiny", "tiny-llama"):
        from bcdflow.models import get_config
        from bcdflow.models.build import param_shapes

        cfg = get_config(family, qkv_bias=family == "tiny-llama")
        for name in param_shapes(cfg):
            assert hfmap.our_name(cfg, hfmap.hf_name(cfg, name)) == name
    gpt = hfmap.config_from_hf({"architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 8, "n_head": 2,
                                "n_positions": 16, "vocab_size": 10})
    assert hfmap.our_name(gpt, "h.1.attn.c_attn.weight") == "h.1.attn.c_attn.weight"  # openai-community layout
    assert hfmap.our_name(gpt, "transformer.h.1.attn.bias") is None  # a buffer, not a parameter


# -- fine-tuning end to end ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_finetune_prompt_completion_through_the_cli(prefect_server, tmp_path, tok_dir, capsys):
    """A BCD fine-tune of a checkpoint on prompt/completion records via the CLI: the first step's loss is the
    checkpoint's cross-entropy over completion tokens only (computed by hand with transformers, for the
    block-0 visit that reads tokens and the block-1 visit that reads pre-inferred activations), and the
    export loads in transformers, matches our final weights and generates."""
    ck, hf = make_checkpoint(tmp_path / "ck", "llama", tok_dir)
    data = tmp_path / "sft.jsonl"
    qa = [("what is two plus two?", " four."), ("is the fox quick?", " yes, the fox is quick."),
          ("is the dog lazy?", " yes."), ("hello", " world")]
    data.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in qa * 12))
    store = tmp_path / "store"
    sets = [f"model.from_hf={ck}", f"data.files={data}", "data.format=prompt_completion", "data.seq_len=24",
            "bcd.blocks=2", "bcd.cycles=1", "bcd.max_steps=3", "bcd.window=3", "bcd.patience=0", "bcd.shard_rows=8",
            "optim.lr=0.003", "train.batch_size=4", "train.eval_rows=8",
            f"tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    args = ["train", "--run-id", "ft", "--store", str(store)]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0, capsys.readouterr().err
    cfg = load_config(sets=sets + [f"store={store}"])
    state = runs.read_state(open_store(cfg), "ft")
    assert [(v.cycle, v.block) for v in state.visits] == [(0, 0), (0, 1)]
    ctx = RunContext.of(cfg, "ft", state.dataset)
    assert ctx.dataset.masked

    from bcdflow.core.rules import visit_rows

    for visit in state.visits:
        rows = visit_rows(cfg, ctx.dataset.n_train, visit.cycle, visit.block)[: cfg.train.batch_size]
        x, y = ctx.dataset.train_pairs(rows)
        assert 0 < int((y != -100).sum()) < y.numel()  # prompts are masked, completions are not
        if visit.version == 1:
            ref = hf  # the untouched checkpoint
        else:  # version 1 in transformers' hands, through our own export
            export_hf(ctx.store, "ft", visit.version - 1, str(tmp_path / f"v{visit.version - 1}"))
            ref, _ = load_clean(tmp_path / f"v{visit.version - 1}")
        with torch.no_grad():
            logits = ref(x).logits
        keep = y != -100
        by_hand = F.cross_entropy(logits[keep], y[keep]).item()  # completion tokens only
        every = torch.from_numpy(ctx.dataset.train_rows(rows)[:, 1:]).long()  # the same rows, nothing masked
        unmasked = F.cross_entropy(logits.flatten(0, 1), every.flatten()).item()
        assert abs(visit.first_loss - by_hand) <= 1e-5, (visit.block, visit.first_loss, by_hand)
        assert abs(visit.first_loss - unmasked) > 1e-3  # the mask matters

    out = tmp_path / "export"
    assert main(["export", "ft", str(out), "--store", str(store), "--format", "hf"]) == 0
    model, tok = load_clean(out)
    final = ctx.load_part(ctx.manifest(state.version), (0, ctx.model_cfg.n_layer), embed=True, head=True).eval()
    ids = tok("what is two plus two?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert (model(ids).logits - final(ids)).abs().max().item() <= 1e-5
        gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert ids.shape[1] < gen.shape[1] <= ids.shape[1] + 4 and torch.equal(gen[:, : ids.shape[1]], ids)

    # MLflow's model artifact is the same Hugging Face directory
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    local = client.download_artifacts(state.mlflow_run_id, "model", str(tmp_path / "mlflow-model"))
    assert json.loads(open(os.path.join(local, "config.json")).read())["architectures"] == ["LlamaForCausalLM"]
    load_clean(local)


def test_chat_data_uses_the_checkpoints_template(tmp_path, tok_dir):
    ck, _ = make_checkpoint(tmp_path / "ck", "qwen2", tok_dir)
    conv = [{"role": "user", "content": "is the fox quick?"}, {"role": "assistant", "content": "yes."}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": conv}) + "\n" for _ in range(12)))
    cfg = load_config(sets=[f"model.from_hf={ck}", f"data.files={path}", "data.format=chat", "data.seq_len=48",
                            "bcd.blocks=2", f"store={tmp_path / 'store'}", "tracking_uri=none"])
    ds = RunContext.of(cfg, "c", prepare_data.fn(cfg, open_store(cfg))).dataset
    x, y = ds.train_pairs(np.array([0]))
    tok = ds.tokenizer()
    assert tok.decode(y[0][y[0] != -100].tolist(), skip_special_tokens=False) == "yes.<|im_end|>\n"


@pytest.mark.parametrize("name,over", [("tiny", {}), ("tiny", {"tie_embeddings": False}),
                                       ("tiny-llama", {}), ("tiny-llama", {"qkv_bias": True, "tie_embeddings": True}),
                                       ("tiny-llama", {"rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
                                                                        "high_freq_factor": 4.0,
                                                                        "original_max_position_embeddings": 64}})])
def test_config_to_hf_and_back_is_the_same_model(name, over):
    from bcdflow.models import get_config
    from bcdflow.models.build import param_shapes
    from bcdflow.models.model_config import ModelConfig
    from tests.helpers import count_params

    cfg = get_config(name, **over)
    back = hfmap.config_from_hf(hfmap.config_to_hf(cfg, hfmap.default_architecture(cfg), "float32"))
    assert param_shapes(back) == param_shapes(cfg) and count_params(back) == count_params(cfg)
    assert sum(torch.Size(s).numel() for s in param_shapes(cfg).values()) == count_params(cfg)
    for field in ("family", "n_ctx", "norm_eps", "rope_theta", "rope_scaling", "tied", "qkv_bias", "ffn_dim",
                  "kv_heads"):
        assert getattr(back, field) == getattr(cfg, field), field
    stored = json.loads(json.dumps(cfg.to_dict()))  # model_resolved as a run's config.json keeps it
    assert ModelConfig.from_dict(stored) == cfg


def test_the_checkpoint_is_checked_once_per_run_start(tmp_path, tok_dir, corpus, monkeypatch):
    """The CLI's preflight checks every file and tensor of ``model.from_hf``; the data check of a resumed run and the
    flow's token dataset took it two and three more times (every tensor's header, the tokenizer). A file changed since
    is checked again."""
    from bcdflow.core import hf_import
    from bcdflow.core.context import preflight
    from bcdflow.tasks.data import data_id

    ck, _ = make_checkpoint(tmp_path / "ck", "llama", tok_dir)
    cfg = run_cfg(tmp_path, ck, corpus)
    calls = []
    monkeypatch.setattr(hf_import, "tensor_names", lambda *a: calls.append(1) or {})
    preflight(cfg)
    data_id(cfg)
    prepare_data.fn(cfg, open_store(cfg))
    assert len(calls) == 1
    os.utime(os.path.join(ck, "config.json"), ns=(1, 1))
    data_id(cfg)
    assert len(calls) == 2
