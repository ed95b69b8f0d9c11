"""Supervised fine-tuning data (storage/sft.py, storage/tokens.py): packing, the loss mask, chat templates
rendered as transformers renders them, and a loss that counts completion tokens only.

Run: python -m pytest -q tests/test_sft.py   (CPU, a few seconds)
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bcdflow.models import build_model, get_config
from bcdflow.storage import sft
from bcdflow.storage.errors import DataError
from bcdflow.storage.store import Store
from bcdflow.constants import IGNORE_INDEX
from bcdflow.storage.tokens import DamagedDataset, TokenDataset, dataset_id, prepare_token_dataset
from tests.hf_checkpoints import CHATML, make_tokenizer

LLAMA3_LIKE = (  # a system block with a date, bos_token, {% generation %} markers, loop controls
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set sys = '' %}{% endif %}"
    "<|im_start|>system\nToday: {{ strftime_now('%d %b %Y') }} {{ sys }}<|im_end|>\n"
    "{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "four."}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "hello world"}, {"role": "user", "content": "is the fox quick?"},
     {"role": "assistant", "content": " yes, the fox is quick. "}],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def tok(tok_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{tok_dir}/tokenizer.json")


# -- packing --------------------------------------------------------------------------------------------------
def _ex(n_prompt: int, n_completion: int, start: int = 10):
    ids = np.arange(start, start + n_prompt + n_completion, dtype=np.int32)
    return ids, np.array([0] * n_prompt + [1] * n_completion, dtype=np.uint8)


def test_pack_keeps_examples_whole_truncates_long_ones_and_drops_untrainable():
    examples = [_ex(3, 2, 10), _ex(2, 2, 20), _ex(4, 1, 30),  # 5 + 4 fill a row of 9; the third starts a new row
                _ex(3, 9, 40),                                   # 12 > 9: cut to a row of its own
                _ex(9, 3, 60),                                   # its prompt fills the row: nothing left to train
                _ex(1, 1, 80)]                                   # in order: after the cut one, not back in row 2
    rows, mask, stats = sft.pack(examples, width=9, pad_id=0)
    assert stats == {"n_examples": 6, "n_truncated": 2, "n_dropped": 1, "n_target_tokens": 2 + 2 + 1 + 6 + 1}
    assert rows.tolist() == [[10, 11, 12, 13, 14, 20, 21, 22, 23],
                             [30, 31, 32, 33, 34, 0, 0, 0, 0],
                             [40, 41, 42, 43, 44, 45, 46, 47, 48],
                             [80, 81, 0, 0, 0, 0, 0, 0, 0]]
    assert mask.tolist() == [[0, 0, 0, 1, 1, 0, 0, 1, 1],
                             [0, 0, 0, 0, 1, 0, 0, 0, 0],
                             [0, 0, 0, 1, 1, 1, 1, 1, 1],
                             [0, 1, 0, 0, 0, 0, 0, 0, 0]]


def test_empty_prompt_never_trains_the_first_token():
    rows, mask, _ = sft.pack([_ex(0, 3)], width=4, pad_id=0)
    assert mask.tolist() == [[0, 1, 1, 0]]


# -- chat templates -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", [CHATML, LLAMA3_LIKE], ids=["chatml", "llama3-like"])
def test_chat_rendering_matches_transformers(hf_tok, template):
    special = {"bos_token": "<|im_start|>", "eos_token": "<|endoftext|>"}
    ours = sft.ChatTemplate(template, special)
    for conv in CONVERSATIONS:
        for gen in (False, True):
            want = hf_tok.apply_chat_template(conv, chat_template=template, tokenize=False,
                                              add_generation_prompt=gen, bos_token=special["bos_token"])
            got = ours.render(conv, add_generation_prompt=gen)
            if template is LLAMA3_LIKE:  # transformers puts today's date in; we fix ours for reproducible data
                assert "Today: 26 Jul 2024" in got
                want = want.replace(want.split("Today: ")[1][:11], "26 Jul 2024")
            assert got == want


def test_chat_mask_covers_assistant_turns_only(tok):
    template = sft.ChatTemplate(CHATML, {"eos_token": "<|endoftext|>"})
    (ids, mask), = sft.encode_chat(tok, [CONVERSATIONS[1]], template)
    assert tok.decode(ids.tolist(), skip_special_tokens=False) == template.render(CONVERSATIONS[1])
    trained = tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
    assert trained == "hello world<|im_end|>\n yes, the fox is quick. <|im_end|>\n"


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    rewrites = ("{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m['role'] }}: {{ m['content'] }}\n"
                "{% endfor %}")
    with pytest.raises(DataError, match=r"^data\.format: .* incrementally"):
        sft.encode_chat(tok, [CONVERSATIONS[1]], sft.ChatTemplate(rewrites))
    with pytest.raises(DataError, match=r"^data\.format: the chat template refused"):
        sft.ChatTemplate("{{ raise_exception('roles must alternate') }}").render(CONVERSATIONS[0])


# -- the dataset: mask stored, targets masked ----------------------------------------------------------------
def _records(tmp_path, name: str, records: list[dict]) -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


PAIRS = [("what is two plus two?", " four."), ("is the fox quick?", " yes, the fox is quick."), ("hello", " world")]


def test_prompt_completion_dataset_masks_prompts(tmp_path, tok_dir, tok):
    store = Store(str(tmp_path / "store"))
    files = _records(tmp_path, "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS * 8])
    ds_id = prepare_token_dataset(store, files=files, seq_len=32, vocab_size=300, format="prompt_completion",
                                  tokenizer_file=f"{tok_dir}/tokenizer.json", eos_token="<|endoftext|>")
    ds = TokenDataset.open(store, ds_id)
    assert ds.masked and ds.meta["data_format"] == "prompt_completion" and ds.meta["n_dropped"] == 0
    rows = ds.train_rows(np.arange(ds.n_train))
    x, y = ds.train_pairs(np.arange(ds.n_train))
    assert torch.equal(x, torch.from_numpy(rows[:, :-1]).long())
    kept = y != IGNORE_INDEX
    assert torch.equal(y[kept], torch.from_numpy(rows[:, 1:]).long()[kept])
    # what is trained in the first row: exactly the completions and their end-of-text tokens
    trained = tok.decode(y[0][kept[0]].tolist(), skip_special_tokens=False)
    assert trained in {"".join(c + "<|endoftext|>" for _, c in PAIRS[i:i + k]) for i in range(3) for k in (1, 2, 3)}
    # the mask is checksummed like the tokens, and part of the dataset's identity
    vx, vy = ds.val_pairs()
    assert vx.shape == vy.shape == (ds.n_val, 32) and bool((vy == IGNORE_INDEX).any())
    same = dict(files=[files], seq_len=32, vocab_size=300, tokenizer_file=f"{tok_dir}/tokenizer.json",
                eos_token="<|endoftext|>")
    assert dataset_id(**same, format="prompt_completion") == ds_id
    assert dataset_id(**same, format="text") != ds_id


def test_altered_mask_is_refused(tmp_path, tok_dir):
    import zarr

    store = Store(str(tmp_path / "store"))
    files = _records(tmp_path, "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS * 8])
    ds_id = prepare_token_dataset(store, files=files, seq_len=20, vocab_size=300, format="prompt_completion",
                                  tokenizer_file=f"{tok_dir}/tokenizer.json", eos_token="<|endoftext|>")
    arr = zarr.open_array(store=store.zarr_store("datasets", ds_id, "train_mask.zarr"), mode="r+")
    arr[0, :] = 1  # "train on the prompts too"
    with pytest.raises(DamagedDataset, match="train_mask.zarr checksum mismatch"):
        TokenDataset(store, ds_id, store.read_json("datasets", ds_id, "meta.json")).train_pairs(np.array([0]))


def test_sft_records_need_their_fields(tmp_path, tok_dir):
    store = Store(str(tmp_path / "store"))
    files = _records(tmp_path, "bad.jsonl", [{"prompt": "a", "answer": "b"}] * 4)
    with pytest.raises(DataError, match=r"^data\.files: no field 'completion'"):
        prepare_token_dataset(store, files=files, seq_len=8, vocab_size=300, format="prompt_completion",
                              tokenizer_file=f"{tok_dir}/tokenizer.json", eos_token="<|endoftext|>")
    text = tmp_path / "plain.txt"
    text.write_text("just text")
    with pytest.raises(DataError, match=r"^data\.format: .* plain text"):
        prepare_token_dataset(store, files=str(text), seq_len=8, vocab_size=300, format="prompt_completion",
                              tokenizer_file=f"{tok_dir}/tokenizer.json", eos_token="<|endoftext|>")
    assert not store.exists("datasets")


# -- the loss counts completion tokens only ----------------------------------------------------------------
def test_masked_loss_and_evaluation_count_completion_tokens_only(tmp_path, tok_dir, tiny_cfg):
    from bcdflow.tasks.train import evaluate_model, val_batches

    store = Store(str(tmp_path / "store"))
    files = _records(tmp_path, "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS * 40])
    ds_id = prepare_token_dataset(store, files=files, seq_len=32, vocab_size=300, format="prompt_completion",
                                  tokenizer_file=f"{tok_dir}/tokenizer.json", eos_token="<|endoftext|>",
                                  val_fraction=0.2)
    ds = TokenDataset.open(store, ds_id)
    torch.manual_seed(0)
    model = build_model(get_config("tiny-llama", d_model=32, n_head=4, n_layer=2, vocab_size=300)).eval()
    x, y = ds.val_pairs()
    with torch.no_grad():
        logits = model(x)  # (n, T, V)
    # by hand: mean negative log-likelihood over the unmasked positions of every row
    logp = torch.log_softmax(logits.double(), -1)
    nll = [-logp[i, j, y[i, j]] for i in range(y.shape[0]) for j in range(y.shape[1]) if y[i, j] != IGNORE_INDEX]
    by_hand = float(torch.stack(nll).mean())
    assert len(nll) < y.numel()
    with torch.no_grad():
        assert abs(float(model(x, y)) - by_hand) < 1e-5  # the training loss (one batch)
    cfg = tiny_cfg("train.batch_size=3", f"train.eval_rows={ds.n_val}")  # uneven batches: token weighting
    assert abs(evaluate_model(model, val_batches(ds, cfg, 3), cfg, torch.device("cpu")) - by_hand) < 1e-5
    every = torch.from_numpy(ds.val_rows()[:, 1:]).long()
    assert abs(F.cross_entropy(logits.flatten(0, 1), every.flatten()).item() - by_hand) > 1e-3



def test_trained_tokens_count_the_unmasked_targets_only(tmp_path, tok_dir):
    """``tokens`` and ``tokens_per_s`` of a supervised visit count completion positions: the step loop's count of a
    batch (``tasks/engine.counted``), and the mask-only count a distributed visit uses, agree with the targets."""
    import itertools

    import numpy as np

    from bcdflow.models.trainer import OptimSpec, StopRule, make_optimizer, run_steps
    from bcdflow.tasks.engine import counted

    store = Store(str(tmp_path / "store"))
    files = _records(tmp_path, "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS * 40])
    ds = TokenDataset.open(store, prepare_token_dataset(
        store, files=files, seq_len=32, vocab_size=300, format="prompt_completion",
        tokenizer_file=f"{tok_dir}/tokenizer.json", eos_token="<|endoftext|>", val_fraction=0.2))
    idx = np.array([3, 0, 5, 1])
    _, y = ds.train_pairs(idx)
    trained = int((y != IGNORE_INDEX).sum())
    assert 0 < trained < y.numel()
    assert ds.trained_tokens(idx) == trained
    batch = counted(lambda a, b: ds.train_pairs(idx[a:b]))(0, 4)
    assert batch[2] == trained
    w = torch.nn.Parameter(torch.ones(1))
    spec = OptimSpec("sgd", lr=0.0, grad_clip=0.0)
    res = run_steps(lambda b: (w * 0).sum(), [w], itertools.repeat(batch), make_optimizer([w], spec), spec,
                    StopRule(max_steps=2, window=2))
    assert res.tokens == 2 * trained
    # without the count the loop still leaves the masked targets out (CPU targets), never counts B x T
    res = run_steps(lambda b: (w * 0).sum(), [w], itertools.repeat(batch[:2]), make_optimizer([w], spec), spec,
                    StopRule(max_steps=2, window=2))
    assert res.tokens == 2 * trained
