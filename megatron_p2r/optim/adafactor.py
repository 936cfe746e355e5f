"""Adafactor (Shazeer & Stern 2018) as ``torch.optim.Adafactor`` computes it — factored second
moments, relative step size, update clipping, no first moment — over flat ranges of parameters.

A weight of shape (..., R, C) keeps a row statistic (R values) and a column statistic (C values)
per matrix instead of R x C second moments; vectors keep an elementwise variance. Three of
torch's quantities are sums over the whole matrix: the row/column means of g^2, the weight's
RMS (the relative step) and the update's RMS (the clipping). Under the distributed optimizer a
rank steps a flat range of each parameter (``Piece``), possibly cutting a matrix in two; the
ranks that share such a matrix add their partial sums (``SharedPieces``: two small all-reduces
per step) and each keeps the whole row and column statistics, so every element gets the update
the one-process run gives it (up to the order of the sums). Gradients below fp32
(``--main-grads-dtype bf16``) are upcast one piece at a time.

On CPU a factored piece with fp32 mains is stepped by the host kernels (``optim/host_kernels.py``)
in three passes over memory — the sums, the update's sum of squares, the update — without ever
holding the update: the same arithmetic element by element, with the sums taken in double in a
fixed order (the only difference from the torch path; the bound is tested in
tests/optim/test_host_kernels.py). The update's pass also sums the new main's squares, in pass
1's order, so the next step's pass 1 reads the gradient alone; that sum is used only while the
main is untouched since (same address, same version counter; a state dict load forgets it),
else pass 1 reads the main again.

Where this differs from torch: a stacked parameter (experts: E x R x C) is E matrices, each with
its own RMS and clipping (torch takes one RMS over the whole tensor), so the expert-parallel
size does not change the arithmetic; under tensor parallelism each rank's shard of a split
weight is factored as a matrix of its own.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron_p2r.optim import host_kernels


@dataclass(frozen=True)
class Piece:
    """The flat range [start, end) of a parameter of ``shape`` that one main parameter holds."""

    shape: Tuple[int, ...]
    start: int
    end: int

    @property
    def factored(self) -> bool:
        return len(self.shape) >= 2

    @property
    def batches(self) -> int:
        return math.prod(self.shape[:-2]) if self.factored else 1

    @property
    def rows(self) -> int:
        return self.shape[-2] if self.factored else 1

    @property
    def cols(self) -> int:
        return self.shape[-1] if self.factored else math.prod(self.shape)

    def stat_sizes(self) -> Tuple[int, int]:
        """Values summed over the ranks sharing the piece: before the update (row sums, column
        sums, weight sum of squares, per matrix) and after it (update sum of squares)."""
        b = self.batches
        return (b * (self.rows + self.cols) + b if self.factored else 1), b

    def row_span(self) -> Tuple[int, int]:
        """The rows [lo, hi) of the (B x R) x C matrix the piece touches."""
        return self.start // self.cols, -(-self.end // self.cols)

    def matrix_of_rows(self, device: torch.device) -> torch.Tensor:
        """The matrix index of each row the piece touches."""
        lo, hi = self.row_span()
        return torch.arange(lo, hi, device=device) // self.rows

    def padded(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (this piece's elements) as whole rows, zeros around it (a view when the
        piece is whole rows, as every parameter a rank steps whole is)."""
        (lo, hi), c = self.row_span(), self.cols
        if self.start == lo * c and self.end == hi * c:
            return flat.view(hi - lo, c)
        out = flat.new_zeros((hi - lo) * c)
        out[self.start - lo * c : self.end - lo * c] = flat
        return out.view(hi - lo, c)

    def unpadded(self, rows: torch.Tensor) -> torch.Tensor:
        lo = self.start // self.cols
        return rows.reshape(-1)[self.start - lo * self.cols : self.end - lo * self.cols]

    def per_matrix(self, flat: torch.Tensor) -> torch.Tensor:
        """Sum of ``flat`` (this piece's elements) over each matrix: B values."""
        if self.batches == 1:
            return flat.sum().reshape(1)
        return flat.new_zeros(self.batches).index_add_(0, self.matrix_of_rows(flat.device), self.padded(flat).sum(1))

    def broadcast(self, per_matrix: torch.Tensor) -> torch.Tensor:
        """A per-matrix value for each element of the piece (a scalar for one matrix)."""
        if self.batches == 1:
            return per_matrix.reshape(())
        return self.unpadded(per_matrix[self.matrix_of_rows(per_matrix.device)][:, None].expand(-1, self.cols))


@dataclass(frozen=True)
class FactoredUpdate:
    """A factored piece's update as the host kernels compute it element by element (never held):
    grad x rsqrt(max(row_var x col_var / mean, floor))."""

    row_var: torch.Tensor
    col_var: torch.Tensor
    mean: torch.Tensor
    floor: float


Update = Union[torch.Tensor, FactoredUpdate]  # an update held (torch path) or described (kernels)


@dataclass
class SharedPieces:
    """The parameters of one reduction group that several of its ranks each step part of. Every
    member lays their sums out alike (in ``shapes`` order; zeros for pieces it holds none of)."""

    group: Optional[dist.ProcessGroup]
    shapes: List[Tuple[int, ...]]
    device: torch.device

    def offsets(self, phase: int) -> List[int]:
        """Where each piece's sums of ``phase`` start in the summed vector (and its length, last)."""
        return [0, *itertools.accumulate(Piece(s, 0, 0).stat_sizes()[phase] for s in self.shapes)]

    def all_reduce(self, values: torch.Tensor) -> torch.Tensor:
        on_device = values.to(self.device)
        dist.all_reduce(on_device, group=self.group)
        return on_device.to(values.device)


class Adafactor(torch.optim.Optimizer):
    """Adafactor over main parameters that are ``pieces[id(main)]`` of their weights;
    ``shared[id(main)]``: (its ``SharedPieces``, index) when other ranks step the rest of it.
    A rank sharing pieces steps even with no parameter of its own here (the sums are collective)."""

    def __init__(
        self,
        groups: list,
        pieces: Dict[int, Piece],
        lr: float,
        beta2_decay: float = -0.8,
        eps: Tuple[Optional[float], float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        shared: Optional[Dict[int, Tuple[SharedPieces, int]]] = None,
        channels: Tuple[SharedPieces, ...] = (),
    ):
        super().__init__(groups, dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay))
        self.pieces, self.shared, self.channels = pieces, dict(shared or {}), channels
        # id(main) -> (its per-matrix sum of squares, as pass 3 left it; (address, version) then)
        self._weight_sq: Dict[int, Tuple[torch.Tensor, Tuple[int, int]]] = {}
        self.register_load_state_dict_post_hook(lambda opt: opt._weight_sq.clear())

    def _state_of(self, p: torch.Tensor) -> dict:
        state, piece = self.state[p], self.pieces[id(p)]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            if piece.factored:
                state["row_var"] = p.new_zeros(piece.batches * piece.rows)
                state["col_var"] = p.new_zeros(piece.batches * piece.cols)
            else:
                state["variance"] = p.new_zeros(p.numel())
        return state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Adafactor takes no closure")
        stepped = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        for p, group in stepped:
            if id(p) not in self.shared:
                update, sums = self._update(p, group, self._sums(p))
                self._apply(p, group, update, sums, self._update_sums(p, update))
        if not self.channels:
            return
        mine = [(p, group) for p, group in stepped if id(p) in self.shared]
        before = self._reduce(mine, 0, lambda p: self._sums(p))
        updates = {id(p): self._update(p, group, before[id(p)]) for p, group in mine}
        after = self._reduce(mine, 1, lambda p: self._update_sums(p, updates[id(p)][0]))
        for p, group in mine:
            update, sums = updates[id(p)]
            self._apply(p, group, update, sums, after[id(p)])

    def _reduce(self, mine: list, phase: int, local) -> Dict[int, torch.Tensor]:
        """Each shared piece's sums over the ranks sharing it (``local``: this rank's part)."""
        out: Dict[int, torch.Tensor] = {}
        for channel in self.channels:
            offsets = channel.offsets(phase)
            values = torch.zeros(offsets[-1], dtype=torch.float32)
            held = [(p, self.shared[id(p)][1]) for p, _ in mine if self.shared[id(p)][0] is channel]
            for p, i in held:
                values[offsets[i] : offsets[i + 1]] = local(p).cpu()
            values = channel.all_reduce(values)
            for p, i in held:
                out[id(p)] = values[offsets[i] : offsets[i + 1]].to(p.device)
        return out

    def _on_kernels(self, p: torch.Tensor) -> bool:
        return self.pieces[id(p)].factored and p.dtype == torch.float32 and host_kernels.steps(p, p.grad)

    def _sums(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's part of the per-matrix sums the update needs: row and column sums of g^2
        (factored), the weight's sum of squares."""
        piece = self.pieces[id(p)]
        if self._on_kernels(p):
            known = self._weight_sq.get(id(p))
            fresh = known is not None and known[1] == (p.data_ptr(), p._version)
            sums = host_kernels.adafactor_sums(
                piece.start, piece.rows, piece.cols, piece.batches, p.grad.view(-1), None if fresh else p.view(-1)
            )
            if fresh:
                sums[-piece.batches :] = known[0]
            return sums
        grad, weight = p.grad.reshape(-1).float(), p.reshape(-1)
        weight_sq = piece.per_matrix(weight * weight)
        if not piece.factored:
            return weight_sq
        rows, (lo, hi) = piece.padded(grad * grad), piece.row_span()
        row_sums = grad.new_zeros(piece.batches * piece.rows)
        row_sums[lo:hi] = rows.sum(1)
        col_sums = grad.new_zeros(piece.batches, piece.cols).index_add_(0, piece.matrix_of_rows(grad.device), rows)
        return torch.cat([row_sums, col_sums.view(-1), weight_sq])

    def _update(self, p: torch.Tensor, group: dict, sums: torch.Tensor) -> Tuple[Update, torch.Tensor]:
        """Advance the statistics and return the unscaled update of this piece (and the sums)."""
        piece, state = self.pieces[id(p)], self._state_of(p)
        state["step"] += 1
        beta = float(state["step"]) ** group["beta2_decay"]
        eps1 = group["eps"][0] if group["eps"][0] is not None else torch.finfo(p.dtype).eps
        if piece.factored:
            b, r, c = piece.batches, piece.rows, piece.cols
            state["row_var"].lerp_(sums[: b * r] / c, beta)
            state["col_var"].lerp_(sums[b * r : b * (r + c)] / r, beta)
            mean = state["row_var"].view(b, r).mean(1).clamp_(min=eps1)
            if self._on_kernels(p):
                return FactoredUpdate(state["row_var"], state["col_var"], mean, eps1 * eps1), sums
            grad = p.grad.reshape(-1).float()
            (lo, hi), matrix = piece.row_span(), piece.matrix_of_rows(grad.device)
            estimate = state["row_var"][lo:hi, None] * state["col_var"].view(b, c)[matrix]
            variance = piece.unpadded(estimate.div_(mean[matrix][:, None]))
        else:
            grad = p.grad.reshape(-1).float()
            state["variance"].lerp_(grad * grad, beta)
            variance = state["variance"].clone()
        return variance.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad), sums

    def _update_sums(self, p: torch.Tensor, update: Update) -> torch.Tensor:
        piece = self.pieces[id(p)]
        if isinstance(update, FactoredUpdate):
            return host_kernels.adafactor_update_sums(
                piece.start,
                piece.rows,
                piece.cols,
                piece.batches,
                p.grad.view(-1),
                update.row_var,
                update.col_var,
                update.mean,
                update.floor,
            )
        return piece.per_matrix(update * update)

    def _apply(self, p: torch.Tensor, group: dict, update: Update, sums: torch.Tensor, update_sq: torch.Tensor) -> None:
        """w = w (1 - lr wd) - alpha / clip x update, per matrix: alpha = max(eps2, RMS(w)) x
        min(lr, 1/sqrt(t)), clip = max(1, RMS(update) / d)."""
        piece, step = self.pieces[id(p)], float(self.state[p]["step"])
        n = piece.rows * piece.cols
        weight_sq = sums[-piece.batches :]
        rho = min(group["lr"], 1 / step**0.5)
        alpha = (weight_sq / n).sqrt_().clamp_(min=group["eps"][1]) * rho
        clip = ((update_sq / n).sqrt_() / group["d"]).clamp_(min=1.0)
        if isinstance(update, FactoredUpdate):
            decay = 1 - group["lr"] * group["weight_decay"] if group["weight_decay"] else 1.0
            weight_sq = host_kernels.adafactor_apply(
                piece.start,
                piece.rows,
                piece.cols,
                p.grad.view(-1),
                p.view(-1),
                update.row_var,
                update.col_var,
                update.mean,
                update.floor,
                alpha / clip,
                decay,
            )
            self._weight_sq[id(p)] = (weight_sq, (p.data_ptr(), p._version))
            return
        if group["weight_decay"]:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        p.view(-1).sub_(update.mul_(piece.broadcast(alpha / clip)))


def checkpoint_value(state: dict, piece: Piece, kind: str) -> torch.Tensor:
    """Statistic ``kind`` broadcast over the piece's elements: a matrix's row (column) statistic
    repeated along its columns (rows); a vector is one row, its variance its ``col_var`` and
    ``row_var`` ones. The checkpoint entry is taken of it (``optim/factored_form.py``)."""
    if not piece.factored:
        var = state["variance"]
        return var.clone() if kind == "col_var" else torch.ones_like(var)
    lo, hi = piece.row_span()
    if kind == "row_var":
        return piece.unpadded(state["row_var"][lo:hi, None].expand(-1, piece.cols))
    matrix = piece.matrix_of_rows(state["col_var"].device)
    return piece.unpadded(state["col_var"].view(piece.batches, piece.cols)[matrix])


def take_checkpoint_value(
    kept: Dict[str, torch.Tensor],
    piece: Piece,
    kind: str,
    offset: int,
    flat: torch.Tensor,
    variance_kind: str = "col_var",
) -> None:
    """Fill ``kept`` (a main's state being loaded) from the elements [offset, offset + n) of
    statistic ``kind`` broadcast over a weight (``checkpoint_value``): the first column gives the
    row statistic, each matrix's first row its column statistic; a vector's range of
    ``variance_kind`` is its variance (``row_var`` in the broadcast checkpoints of before issue 37)."""
    end = offset + flat.numel()
    if not piece.factored:
        if kind == variance_kind:
            lo, hi = max(piece.start, offset), min(piece.end, end)
            kept.setdefault("variance", torch.zeros(piece.end - piece.start))
            kept["variance"][lo - piece.start : hi - piece.start] = flat[lo - offset : hi - offset]
        return
    b, r, c = piece.batches, piece.rows, piece.cols
    if kind == "row_var":
        var = kept.setdefault("row_var", torch.zeros(b * r))
        first, last = -(-offset // c), -(-end // c)
        var[first:last] = flat[first * c - offset : last * c - offset : c]
    else:
        var = kept.setdefault("col_var", torch.zeros(b * c))
        for m in range(-(-offset // (r * c)), -(-(end - c + 1) // (r * c))):
            var[m * c : (m + 1) * c] = flat[m * r * c - offset : m * r * c - offset + c]


def take_second_moment(kept: Dict[str, torch.Tensor], piece: Piece, kind: str, offset: int, flat: torch.Tensor) -> None:
    """Fill ``kept`` from the elements [offset, offset + n) of a weight's AdamW second moment
    (``kind``: exp_avg_sq): the mean of each whole row (column) of a matrix in it is that row's
    (column's) statistic; a vector's range is its variance."""
    end = offset + flat.numel()
    if not piece.factored:
        take_checkpoint_value(kept, piece, kind, offset, flat, variance_kind=kind)
        return
    b, r, c = piece.batches, piece.rows, piece.cols
    rows = kept.setdefault("row_var", torch.zeros(b * r))
    cols = kept.setdefault("col_var", torch.zeros(b * c))
    first, last = -(-offset // c), end // c
    if first < last:
        rows[first:last] = flat[first * c - offset : last * c - offset].view(-1, c).mean(1)
    for m in range(-(-offset // (r * c)), end // (r * c)):
        cols[m * c : (m + 1) * c] = flat[m * r * c - offset : (m + 1) * r * c - offset].view(r, c).mean(0)
