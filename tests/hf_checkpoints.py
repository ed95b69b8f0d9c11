"""Tiny Hugging Face checkpoints made in the tests with transformers (nothing is downloaded): a byte-level BPE
with chat special tokens and a ChatML template, and one random model per supported family.

    tok_dir = make_tokenizer(tmp)                    # tokenizer.json, tokenizer_config.json, chat_template.jinja
    ck, model = make_checkpoint(tmp / "ck", "llama", tok_dir)   # model.safetensors + config.json + tokenizer files
"""
from __future__ import annotations

import logging
import os
import shutil

import torch

VOCAB = 300   # tokenizer ids 0..299
ROWS = 320    # embedding rows: padded above the tokenizer, as real checkpoints often are
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = ("The quick brown fox jumps over the lazy dog. Block coordinate descent trains one block at a time "
        "while the others stay frozen; pre-inference stores the frozen prefix's activations. ") * 4


def make_tokenizer(directory) -> str:
    """A byte-level BPE (VOCAB ids, specials first) saved as transformers saves a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT, "hello world, what is two plus two? four. yes, no."] * 8, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", chat_template=CHATML,
                            model_max_length=64).save_pretrained(str(directory))
    return str(directory)


def hf_config(family: str, rows: int = ROWS, **over):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    llama = dict(vocab_size=rows, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    if family == "gpt2":
        kw = dict(n_layer=3, n_embd=32, n_head=4, vocab_size=rows, n_positions=64, bos_token_id=0, eos_token_id=0)
        return GPT2Config(**{**kw, **over})
    if family == "llama":  # untied, grouped-query attention, llama3 rope scaling
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        return LlamaConfig(**{**llama, "tie_word_embeddings": False, "rope_parameters": rope, **over})
    if family == "llama-tied":
        return LlamaConfig(**{**llama, "tie_word_embeddings": True, "rope_parameters":
                              {"rope_type": "default", "rope_theta": 50000.0}, **over})
    if family == "mistral":  # a window longer than the sequences trained on
        return MistralConfig(**{**llama, "sliding_window": 32, **over})
    if family == "qwen2":  # q/k/v biases, tied
        return Qwen2Config(**{**llama, "tie_word_embeddings": True, **over})
    raise ValueError(family)


FAMILIES = ["gpt2", "llama", "llama-tied", "mistral", "qwen2"]


def make_checkpoint(directory, family: str, tok_dir: str, seed: int = 0, dtype=torch.float32,
                    max_shard_size: str | None = None, **over):
    """Save a random model of ``family`` with the tokenizer files beside it; returns (dir, model in eval mode)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **over)).to(dtype).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), os.path.join(str(directory), name))
    return str(directory), model


class LogRecords(logging.Handler):
    """Every WARNING or worse transformers logs (its loggers do not propagate to the root)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        logging.getLogger("transformers").addHandler(self)
        return self.records

    def __exit__(self, *exc):
        logging.getLogger("transformers").removeHandler(self)


def load_clean(directory):
    """AutoModelForCausalLM + AutoTokenizer of an export, asserting transformers reports no missing,
    unexpected or mismatched keys and logs no warning at all."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with LogRecords() as logs:
        model, info = AutoModelForCausalLM.from_pretrained(str(directory), output_loading_info=True)
        tok = AutoTokenizer.from_pretrained(str(directory))
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert [r.getMessage() for r in logs] == []
    return model.eval(), tok
