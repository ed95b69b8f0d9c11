"""Row blocks of a vocabulary matrix (``bcd.vocab_blocks``; docs/DESIGN.md §2.7): a visit that trains rows [lo, hi) of
the token embedding ``wte.weight`` or the untied head ``lm_head.weight`` and nothing else.

The rows of a vocabulary matrix are independent coordinates (a token's embedding row, a token's output row), so block
coordinate descent may take a slice of them as a block. The visit's model holds the whole matrix frozen (in the
frozen dtype: bf16 under ``train.precision=bf16``) and its trainable parameter is a leaf tensor of the slice's rows
only (fp32 master weights, or the optimizer's bf16 ones), so gradient and optimizer state exist for the slice alone:

    rows = attach_rows(model, "wte.weight", lo, hi)   # an nn.Parameter (hi - lo, C); the optimizer's only one
    ...train...                                         # every read of the matrix sees the slice's current rows
    detach_rows(model, "wte.weight")                     # the plain matrix again, the slice written into it

Mechanism: a ``torch.nn.utils.parametrize`` parametrization of the module's ``weight`` (torch's own way to compute a
weight from others on every access, so any read of the matrix sees the slice's current rows). Its forward writes the
slice into the frozen matrix's rows (outside autograd: ``.data``, a slice-sized copy, no version bump) and returns
the matrix through :class:`_Rows`, whose backward hands the slice the rows [lo, hi) of the matrix's gradient. The two
reads that train take the slice's gradient for its rows alone, never the whole matrix's: the loss
(models/base.py ``Decoder.loss`` asks :func:`trained_rows` and computes ``g[:, lo:hi].T @ h`` per loss chunk) and the
embedding lookup (the module's ``forward`` is :func:`_embed_rows` while attached: the lookup of the frozen matrix,
the slice's tokens reading the slice's own rows, whose backward sums the gradients of the tokens in [lo, hi) into the
slice through the embedding's own backward). Both sum in the slice's own dtype (fp32
master weights: fp32 sums, as a whole fp32 matrix's gradient is summed, where the matrix's stored bf16 would round
every partial sum), no gradient of the whole matrix ever exists, and the head's weight-gradient matmul covers the
slice's rows only. In fp32 the slice's gradient is bitwise those rows of the whole matrix's (on the CPU).
"""
from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn.utils import parametrize

from bcdflow.models.plan import VOCAB_MATRICES, LayerVisit

class _Rows(torch.autograd.Function):
    """The matrix ``weight`` (frozen, its rows [lo, lo + n) already holding ``rows``' values) as a function of the
    trainable ``rows``: the gradient of ``rows`` is the rows [lo, lo + n) of the matrix's gradient, in ``rows``' dtype."""

    @staticmethod
    def forward(ctx, weight, rows, lo: int):
        ctx.lo, ctx.n, ctx.dtype = lo, rows.size(0), rows.dtype
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        # a copy, never a view: a view kept as the slice's .grad would keep the whole matrix's gradient alive
        return None, grad[ctx.lo:ctx.lo + ctx.n].to(ctx.dtype, copy=True), None


class RowSlice(nn.Module):
    """The parametrization: the frozen matrix with rows [lo, hi) taken from the trainable ``rows``."""

    def __init__(self, rows: nn.Parameter, lo: int):
        super().__init__()
        self.rows, self.lo = rows, lo

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        weight.data[self.lo:self.lo + self.rows.size(0)].copy_(self.rows.data)  # the slice's current values
        return _Rows.apply(weight, self.rows, self.lo)


class _EmbedRows(torch.autograd.Function):
    """The lookup ``weight[idx]`` (in ``rows``' dtype) of a frozen matrix whose rows [lo, lo + n) hold the trainable
    ``rows``: the gradient of ``rows`` is the sum, in ``rows``' dtype, of the output gradients of the tokens in
    [lo, lo + n)."""

    @staticmethod
    def forward(ctx, idx, weight, rows, lo: int):
        n = rows.size(0)
        mine = (idx >= lo) & (idx < lo + n)
        local = torch.where(mine, idx - lo, n)  # the slice's row of each token, n for the others
        ctx.save_for_backward(local)
        ctx.n, ctx.dtype = n, rows.dtype
        # in the slice's dtype, as a trainable matrix's lookup is (its gradients then come back unrounded), and the
        # slice's tokens read its rows as they are, not as the held matrix rounds them (bf16)
        out = nn.functional.embedding(idx, weight).to(rows.dtype)
        if weight.dtype != rows.dtype:
            out = torch.where(mine.unsqueeze(-1), nn.functional.embedding(local.clamp(max=n - 1), rows), out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (local,) = ctx.saved_tensors
        # the embedding's own backward over n + 1 rows (the last gathers every other token, dropped): the slice's
        # rows summed in its dtype, in the order a whole matrix's are, with no host sync (no boolean indexing)
        out = torch.ops.aten.embedding_dense_backward(grad.to(ctx.dtype), local, ctx.n + 1, -1, False)
        return None, None, out[:ctx.n], None


def _embed_rows(module: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
    weight, (rows, lo) = trained_rows(module)
    return _EmbedRows.apply(idx, weight, rows, lo)


def trained_rows(module: nn.Module) -> tuple[torch.Tensor, tuple[nn.Parameter, int]] | None:
    """A row block's frozen matrix of ``module`` (its slice's current rows written in) and ``(rows, lo)``, the
    trainable slice and where it starts; None when ``module`` trains no row slice."""
    if not parametrize.is_parametrized(module, "weight"):
        return None
    sl = module.parametrizations.weight[0]
    weight = module.parametrizations.weight.original
    weight.data[sl.lo:sl.lo + sl.rows.size(0)].copy_(sl.rows.data)
    return weight, (sl.rows, sl.lo)


def _module(model: nn.Module, name: str) -> nn.Module:
    if name not in VOCAB_MATRICES:
        raise ValueError(f"{name!r} is no vocabulary matrix ({', '.join(VOCAB_MATRICES)})")
    return getattr(model, VOCAB_MATRICES[name])


def attach_rows(model: nn.Module, name: str, lo: int, hi: int, dtype: torch.dtype = torch.float32,
                init: torch.Tensor | None = None) -> nn.Parameter:
    """Make rows [lo, hi) of the vocabulary matrix ``name`` of ``model`` its only trainable part: returns the slice as
    a new leaf parameter (a copy of those rows in ``dtype``: fp32 master weights, or bf16 ones with
    ``optim.name=adamw8bit-bf16``), every other row frozen where the matrix lives. ``init``: the rows as stored
    (``(hi - lo, C)``, any device), where the model holds the matrix rounded (bf16 under ``train.precision=bf16``):
    the slice starts from them, not from the held matrix's rounding of them; None: the held matrix's rows."""
    module = _module(model, name)
    weight = module.weight
    if not 0 <= lo < hi <= weight.size(0):
        raise ValueError(f"rows [{lo}, {hi}) lie outside {name} ({weight.size(0)} rows)")
    if init is not None and tuple(init.shape) != (hi - lo, *weight.shape[1:]):
        raise ValueError(f"the stored rows of {name} have shape {tuple(init.shape)}, not {(hi - lo, *weight.shape[1:])}")
    weight.requires_grad_(False)
    src = weight.detach()[lo:hi] if init is None else init.detach()
    rows = nn.Parameter(src.to(weight.device, dtype, copy=True))
    parametrize.register_parametrization(module, "weight", RowSlice(rows, lo), unsafe=True)
    if isinstance(module, nn.Embedding):  # the lookup's gradient goes to the slice's rows alone
        module.forward = types.MethodType(_embed_rows, module)  # bound: a deep copy binds to the copy
    return rows


def detach_rows(model: nn.Module, name: str) -> None:
    """Undo :func:`attach_rows`: the module's plain ``weight`` again, holding the slice's last rows (in its dtype)."""
    module = _module(model, name)
    if parametrize.is_parametrized(module, "weight"):
        slice_ = module.parametrizations.weight[0]
        with torch.no_grad():
            slice_(module.parametrizations.weight.original)  # the rows written in once more
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
    module.__dict__.pop("forward", None)  # the class's own lookup again


class RowVisit(LayerVisit):
    """The visit kind ``rows`` (``models/plan.VISIT_KINDS``): rows [lo, hi) of one vocabulary matrix (``t.params``,
    ``t.rows``), the matrix held whole and frozen and its rows the one trainable slice; its commit is the stored
    block holding the matrix (``t.stored``) with those rows written in. Its arithmetic is here, beside the
    mechanism: what trains, what the planner counts, what the visit attaches and commits."""

    expands = False  # its commit's block may be a suffix block too (the embedding's rows have every layer after them)

    def label(self, t) -> str:
        return f"{t.params[0]}[{t.rows[0]}:{t.rows[1]}]"

    def report(self, t) -> dict:
        return {"rows": [t.params[0], *t.rows], "label": "emb rows" if t.params[0] == "wte.weight" else "lm rows"}

    def trained_shape(self, t, name: str, shape) -> tuple[int, ...]:
        return (t.rows[1] - t.rows[0], *shape[1:]) if name == t.params[0] else tuple(shape)

    def memory_terms(self, t, terms: dict, m) -> dict:
        """The loss and the lookup make the slice's gradient alone (the whole matrix's never exists): from forward
        on where the matrix is the head's, summed from its tokens' gradients (fp32 copies) where it is the
        embedding's; a loss chunk's partial covers the slice's rows; the frozen matrix is not copied."""
        g = m.grads if m.trained else 0
        return dict(terms, grad_w=g, w_copy=0, partial=m.train_numel if terms["partial"] else 0, other_grads=m.grads,
                    head_back=g, after_head=g, final=m.grads,
                    emb=m.grads + m.N * 4 * m.C if t.params[0] == "wte.weight" else terms["emb"])

    def commit_host_bytes(self, t, file_bytes: int, numel) -> int:
        """It reads the stored block holding its matrix (the file's bytes and its tensors) and copies the matrix."""
        return 2 * file_bytes + 4 * numel[t.params[0]]

    def model_trainable(self, active: frozenset) -> frozenset:
        return frozenset()  # the whole matrix frozen (bf16 under bf16); its rows a trainable slice

    def attach(self, t, model, named: list, master, read_stored) -> list:
        """The slice, starting from the stored rows, never the held matrix's bf16 rounding of them."""
        (name,), (lo, hi) = t.params, t.rows
        return [(name, attach_rows(model, name, lo, hi, master, read_stored(name)[lo:hi].clone()))]

    def commit(self, t, named: list, read_block) -> dict:
        """The stored block as the base version stores it, the matrix's rows [lo, hi) replaced by the slice's (cast
        to its stored dtype); every other tensor and row the stored one, bitwise (I1)."""
        (name,), (lo, hi) = t.params, t.rows
        tensors = read_block()
        matrix = tensors[name].clone()
        matrix[lo:hi] = dict(named)[name].detach().to("cpu", matrix.dtype)
        return {**tensors, name: matrix}
