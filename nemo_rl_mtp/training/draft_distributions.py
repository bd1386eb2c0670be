"""Statistics of the policy's and the MTP heads' distributions, computed row by row over
vocab-parallel logits in chunks of rows: the acceptance-targeted MTP losses (value and gradient in
one pass), the acceptance forecast sum_x min(p, q), and the policy's entropy.

p = softmax(z_p / T) is the policy at the position that predicts a token (detached: a target),
q = softmax(z_q / T) the MTP head's prediction of the same token, both at the sampling temperature
T with the output layer's padding ids excluded, as the sampler sees them. Per row:

* ``soft_cross_entropy``: -sum_x p log q. Gradient w.r.t. z_q: (q - p) / T.
* ``total_variation``: 1 - sum_x min(p, q), the probability that rejection sampling rejects the
  head's draft. Gradient: -(q / T) (1[q < p] - sum_{x: q < p} q).

Memory. At a 150k vocabulary and 8k tokens per microbatch a float [tokens, vocab] tensor is 4.9 GB;
nothing here makes one. Rows are processed a chunk at a time (chunk rows x vocab/tp at most
``CHUNK_ELEMENTS``), each chunk's temporaries are [chunk, vocab/tp] floats, and a loss's gradient
is written into the head's logits themselves (megatron's vocab-parallel cross entropy writes its
softmax there the same way), so a loss keeps no [tokens, vocab] tensor beyond the logits the
forward made anyway. Every row is processed, weighted (0 for prompts, padding and masked samples),
so no per-microbatch host read picks the rows.

Vocab parallelism: each tensor-parallel rank holds a [*, vocab/tp] shard; per chunk the row maxima
are all-reduced (MAX) and the row sums (SUM) over the tensor-parallel group, as megatron's
``vocab_parallel_cross_entropy`` does.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from nemo_rl_mtp.training.vocabulary import first_padding_column

DISTRIBUTION_LOSSES = ("soft_cross_entropy", "total_variation")
# Elements of one [chunk, vocab/tp] float temporary: 2**24 floats are 64 MiB (110 rows at 150k).
CHUNK_ELEMENTS = 1 << 24
# Padding ids: exp() of this after the max is subtracted is 0, as with -inf, and 0 * it is 0, not nan.
_EXCLUDED = -1.0e30


def chunk_rows(vocab_shard: int, chunk_elements: int | None = None) -> int:
    return max(1, (chunk_elements or CHUNK_ELEMENTS) // vocab_shard)


def _tensor_parallel(values: torch.Tensor, op=torch.distributed.ReduceOp.SUM) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(values, op=op, group=parallel_state.get_tensor_model_parallel_group())
    return values


def _scaled(rows: torch.Tensor, temperature: float, padding_column: int | None, owned: bool = False) -> torch.Tensor:
    """rows / T in float, padding ids excluded; a new tensor unless ``owned`` (rows the caller
    made for this, which may then be changed in place)."""
    scaled = rows.float()
    if scaled is rows and not owned:  # float32 rows: .float() is the tensor itself
        scaled = scaled / temperature if temperature != 1.0 else scaled.clone()
    elif temperature != 1.0:
        scaled.div_(temperature)
    if padding_column is not None:
        scaled[:, padding_column:] = _EXCLUDED
    return scaled


def _log_softmax(*scaled: torch.Tensor) -> list[torch.Tensor]:
    """Log-probabilities of each [C, v/tp] row block (vocab-parallel: one MAX and one SUM
    all-reduce for all blocks together; torch's fused log_softmax on a single rank)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return [torch.log_softmax(z, dim=-1) for z in scaled]
    peaks = _tensor_parallel(torch.stack([z.amax(dim=-1) for z in scaled]), torch.distributed.ReduceOp.MAX)
    shifted = [z - peak[:, None] for z, peak in zip(scaled, peaks)]
    log_totals = _tensor_parallel(torch.stack([z.exp().sum(dim=-1) for z in shifted])).log()
    return [z.sub_(total[:, None]) for z, total in zip(shifted, log_totals)]


def _softmax(*scaled: torch.Tensor) -> list[torch.Tensor]:
    """Probabilities of each [C, v/tp] row block (as ``_log_softmax``)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return [torch.softmax(z, dim=-1) for z in scaled]
    return [z.exp_() for z in _log_softmax(*scaled)]


def _total(sums: list[torch.Tensor], device) -> torch.Tensor:
    if not sums:
        return torch.zeros((), device=device)
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum()


class _DraftTerms(torch.autograd.Function):
    """Outputs: the loss scale * sum_r m_r loss_r (differentiable), sum_r m_r loss_r, and the
    overlap sum sum_r f_r sum_x min(p, q). The gradient is computed in the forward and written into
    ``draft_logits`` (whose values are no longer needed)."""

    @staticmethod
    def forward(ctx, draft_logits, policy_logits, policy_index, mask, forecast_mask, scale, loss_type, temperature, vocab_size, chunk):
        vocab_shard = draft_logits.shape[-1]
        draft_rows, policy_rows = draft_logits.view(-1, vocab_shard), policy_logits.reshape(-1, vocab_shard)
        padding_column = first_padding_column(vocab_shard, vocab_size)
        write_gradient = loss_type is not None and ctx.needs_input_grad[0]
        loss_sums, overlap_sums = [], []
        for start in range(0, draft_rows.shape[0], chunk):
            end = min(start + chunk, draft_rows.shape[0])
            zq = _scaled(draft_rows[start:end], temperature, padding_column)
            zp = _scaled(policy_rows.index_select(0, policy_index[start:end]), temperature, padding_column, owned=True)
            if loss_type == "soft_cross_entropy":  # needs log q
                log_q, log_p = _log_softmax(zq, zp)
                q, p = log_q.exp(), log_p.exp_()
            else:
                q, p = _softmax(zq, zp)
            local = [torch.minimum(p, q).sum(dim=-1)]
            if loss_type == "soft_cross_entropy":
                local.append((p * log_q).sum(dim=-1))
            elif loss_type == "total_variation":
                smaller = q < p
                local.append((q * smaller).sum(dim=-1))
            totals = _tensor_parallel(torch.stack(local))
            overlap_sums.append(totals[0].sum() if forecast_mask is None else totals[0] @ forecast_mask[start:end])
            if loss_type is None:
                continue
            weights = mask[start:end]
            if loss_type == "soft_cross_entropy":
                loss_sums.append(-(totals[1] @ weights))  # -sum_x p log q
                gradient = q.sub_(p)
            else:
                loss_sums.append((1.0 - totals[0]) @ weights)
                gradient = q.mul_(totals[1][:, None] - smaller.float())
            if write_gradient:
                gradient.mul_((weights * (scale / temperature))[:, None])
                draft_rows[start:end].copy_(gradient)
        if write_gradient:
            ctx.save_for_backward(draft_logits)
        loss_sum, overlap_sum = (_total(sums, draft_rows.device) for sums in (loss_sums, overlap_sums))
        ctx.mark_non_differentiable(loss_sum, overlap_sum)
        return loss_sum * scale, loss_sum, overlap_sum

    @staticmethod
    def backward(ctx, grad_loss, _grad_value, _grad_overlap):
        if not ctx.saved_tensors:
            return (None,) * 10
        (gradient,) = ctx.saved_tensors
        return (gradient.mul_(grad_loss),) + (None,) * 9


def draft_terms(
    draft_logits: torch.Tensor,
    policy_logits: torch.Tensor,
    policy_index: torch.Tensor,
    mask: torch.Tensor | None,
    forecast_mask: torch.Tensor | None,
    loss_type: str | None,
    scale: float | torch.Tensor,
    temperature: float,
    vocab_size: int,
    chunk_elements: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One MTP depth's loss and forecast sums over its rows.

    draft_logits: the depth's logits, any shape [..., v/tp] (R rows); with a loss type and a graph,
    its storage is overwritten with the gradient. policy_logits: [..., v/tp], read only (detached).
    policy_index [R]: for each draft row, the policy row predicting the same token. mask [R]: loss
    weights per row (0: no target; None: no loss). forecast_mask [R]: 1 where the overlap counts
    (None: every row).
    Returns (scale * sum_r mask_r loss_r, differentiable w.r.t. draft_logits; sum_r mask_r loss_r;
    sum_r forecast_mask_r sum_x min(p, q)); the last two are not differentiable."""
    if loss_type is not None and loss_type not in DISTRIBUTION_LOSSES:
        raise ValueError(f"unknown MTP distribution loss {loss_type!r}; one of {DISTRIBUTION_LOSSES}")
    chunk = chunk_rows(draft_logits.shape[-1], chunk_elements)
    return _DraftTerms.apply(
        draft_logits, policy_logits.detach(), policy_index, mask, forecast_mask, scale, loss_type, temperature, vocab_size, chunk
    )


@torch.no_grad()
def overlap_sum(
    draft_rows: torch.Tensor,
    policy_logits: torch.Tensor,
    policy_index: torch.Tensor,
    temperature: float,
    vocab_size: int,
    chunk_elements: int | None = None,
) -> torch.Tensor:
    """sum_r sum_x min(p_r, q_r) over the rows of ``draft_rows`` [R, v/tp], which the caller owns
    (they are changed in place): the forecast beside megatron's cross entropy, on its copies of
    the heads' logits. ``policy_index`` [R] as in :func:`draft_terms`."""
    vocab_shard = draft_rows.shape[-1]
    policy_rows = policy_logits.reshape(-1, vocab_shard)
    padding_column = first_padding_column(vocab_shard, vocab_size)
    chunk = chunk_rows(vocab_shard, chunk_elements)
    sums = []
    for start in range(0, draft_rows.shape[0], chunk):
        q, p = _softmax(
            _scaled(draft_rows[start : start + chunk], temperature, padding_column, owned=True),
            _scaled(policy_rows.index_select(0, policy_index[start : start + chunk]), temperature, padding_column, owned=True),
        )
        sums.append(_tensor_parallel(torch.minimum(p, q).sum(dim=-1)).sum())
    return _total(sums, draft_rows.device)


@torch.no_grad()
def entropy_sum(
    policy_logits: torch.Tensor, mask: torch.Tensor, temperature: float, vocab_size: int, chunk_elements: int | None = None
) -> torch.Tensor:
    """sum_r mask_r H(p_r), H the entropy of the policy's sampling distribution at each row of
    ``policy_logits`` [..., v/tp] (R rows; ``mask`` [R])."""
    vocab_shard = policy_logits.shape[-1]
    rows, weights = policy_logits.reshape(-1, vocab_shard), mask.reshape(-1).float()
    padding_column = first_padding_column(vocab_shard, vocab_size)
    chunk = chunk_rows(vocab_shard, chunk_elements)
    sums = []
    for start in range(0, rows.shape[0], chunk):
        (log_p,) = _log_softmax(_scaled(rows[start : start + chunk], temperature, padding_column))
        entropy = -_tensor_parallel((log_p.exp() * log_p).sum(dim=-1))
        sums.append(entropy @ weights[start : start + chunk])
    return _total(sums, rows.device)
