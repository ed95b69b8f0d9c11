"""Supervised fine-tuning examples: records in, token ids with a loss mask out, packed into rows.

Two formats (``data.format``), read from json/jsonl/parquet records (``storage.corpus.load_records``):

- ``prompt_completion``: ``{"prompt": str, "completion": str}``. The prompt is encoded as the tokenizer encodes
  one sequence (its post-processor adds a BOS where it has one, as ``tokenizer(prompt)`` does in transformers),
  the completion without special tokens, then the end-of-text token. Trained: the completion and that final
  token. Prompt and completion are encoded separately, so the mask boundary is exact.
- ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered with the checkpoint's chat template
  (jinja2, the environment transformers uses: sandboxed, ``trim_blocks``/``lstrip_blocks``, loop controls,
  ``tojson``, ``raise_exception``, ``{% generation %}`` blocks rendered as plain text), and encoded without
  special tokens (the template writes them). Trained: each assistant turn as the template renders it,
  including its end-of-turn marker. A turn's span is found by rendering the conversation up to it
  with ``add_generation_prompt`` (the prefix) and including it; a template whose renderings are not
  prefixes of each other (e.g. one that rewrites earlier turns) is refused. ``strftime_now`` returns a fixed
  date (26 Jul 2024) so a dataset is the same whenever it is built.

Packing (``pack``): examples are laid into rows of ``seq_len + 1`` tokens in file order, several per row; an
example never straddles two rows (a trained token always sees its own prompt), so a row is closed when the
next example does not fit and its tail is padding (the end-of-text id, never trained). An example longer than
a row is cut to the row (its completion tail is lost) and counted in ``n_truncated``; one with no trained
token left is dropped (``n_dropped``). Within a row, later examples attend to earlier ones (packing without
per-example attention masks, as in pre-training). The first token of an example is never trained.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import numpy as np
from tokenizers import Tokenizer

from .errors import DataError

FORMATS = ("text", "prompt_completion", "chat")
FIELDS = {"prompt_completion": ("prompt", "completion"), "chat": ("messages",)}
FIXED_DATE = datetime(2024, 7, 26)


# -- chat templates ------------------------------------------------------------------------------------------
@lru_cache(maxsize=4)
def _compile(source: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker) as plain text."""
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return body

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes <, >, & for HTML; chat templates expect plain JSON
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: FIXED_DATE.strftime(fmt))
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise DataError(f"data.format: the chat template does not compile ({e})") from None


class ChatTemplate:
    """A tokenizer's chat template with its special tokens (``bos_token``, ``eos_token``, ...) in scope."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        self.source, self.special = source, dict(special_tokens or {})
        self._template = _compile(source)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=None, documents=None, **self.special)
        except jinja2.exceptions.TemplateError as e:
            raise DataError(f"data.format: the chat template refused a conversation ({e})") from None


# -- encoding ------------------------------------------------------------------------------------------------
Example = tuple[np.ndarray, np.ndarray]  # ids (n,) int32, mask (n,) uint8: 1 = trained as a target


def encode_prompt_completion(tok: Tokenizer, prompts: list[str], completions: list[str], eos: int) -> list[Example]:
    out = []
    p_enc = tok.encode_batch(prompts, add_special_tokens=True)
    c_enc = tok.encode_batch(completions, add_special_tokens=False)
    for p, c in zip(p_enc, c_enc):
        ids = np.array([*p.ids, *c.ids, eos], dtype=np.int32)
        mask = np.zeros(len(ids), dtype=np.uint8)
        mask[len(p.ids):] = 1
        out.append((ids, mask))
    return out


def _assistant_spans(template: ChatTemplate, messages: list[dict], full: str, where: str) -> list[tuple[int, int]]:
    spans = []
    for k, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        prefix = template.render(messages[:k], add_generation_prompt=True)
        upto = template.render(messages[:k + 1])
        if not (upto.startswith(prefix) and full.startswith(upto)):
            raise DataError(f"data.format: the chat template does not render {where} incrementally (message {k}: "
                            "a shorter conversation is not a prefix of the longer one), so its assistant "
                            "tokens cannot be told apart")
        spans.append((len(prefix), len(upto)))
    return spans


def encode_chat(tok: Tokenizer, conversations: list[list[dict]], template: ChatTemplate) -> list[Example]:
    out = []
    for n, messages in enumerate(conversations):
        where = f"example {n}"
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise DataError(f"data.files: {where}: 'messages' must be a list of {{role, content}} objects")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # datasets fills gaps
        full = template.render(messages)
        spans = _assistant_spans(template, messages, full, where)
        enc = tok.encode(full, add_special_tokens=False)
        starts = np.array([s for s, _ in enc.offsets], dtype=np.int64)
        mask = np.zeros(len(enc.ids), dtype=np.uint8)
        for lo, hi in spans:
            mask[(starts >= lo) & (starts < hi)] = 1
        out.append((np.asarray(enc.ids, dtype=np.int32), mask))
    return out


# -- packing ---------------------------------------------------------------------------------------------------
def pack(examples: list[Example], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """Rows (N, width) int32 and their mask (N, width) uint8, plus counts (see the module docstring)."""
    rows: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    cur_ids: list[np.ndarray] = []
    cur_mask: list[np.ndarray] = []
    used = truncated = dropped = 0

    def flush():
        nonlocal used
        if not cur_ids:
            return
        row = np.full(width, pad_id, dtype=np.int32)
        m = np.zeros(width, dtype=np.uint8)
        row[:used], m[:used] = np.concatenate(cur_ids), np.concatenate(cur_mask)
        rows.append(row)
        masks.append(m)
        cur_ids.clear()
        cur_mask.clear()
        used = 0

    for ids, mask in examples:
        if len(ids) > width:
            ids, mask = ids[:width], mask[:width]
            truncated += 1
        mask = mask.copy()
        mask[:1] = 0  # an example's first token is never predicted from its own context
        if not mask.any():
            dropped += 1
            continue
        if used + len(ids) > width:
            flush()
        cur_ids.append(ids)
        cur_mask.append(mask)
        used += len(ids)
    flush()
    stats = {"n_examples": len(examples), "n_truncated": truncated, "n_dropped": dropped,
             "n_target_tokens": int(sum(int(m[1:].sum()) for m in masks))}
    if not rows:
        return np.zeros((0, width), np.int32), np.zeros((0, width), np.uint8), stats
    return np.stack(rows), np.stack(masks), stats
