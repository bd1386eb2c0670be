"""MTP drafts from a KV cache of each MTP depth (``policy.generation.draft_context: incremental``,
the default): the drafts of :mod:`sequence_drafts`, at the cost of a few positions per depth and
step instead of the whole sequence.

What the heads compute (training, and the sequence path): depth d (0-based) at position j combines
its input hidden state at j (the decoder's output for d = 0, depth d - 1's output after) with the
embedding of the token at j + d + 1, and its transformer layer attends causally over depth d's
positions 0..j, with the model's rotary embedding at the true positions. A request that has V
verified tokens (positions 0..V-1 in the trunk's KV cache) drafts from position V - 1: depth d's
token there is the sampled token (d = 0) or draft d; so are the tokens of depth d's positions
V - 1 - d .. V - 2, which the query at V - 1 attends to.

So each depth keeps the keys and values of its attention for its *committed* positions, those
whose inputs are all verified (j + d + 1 <= V - 1), on the engine's own KV blocks (the same block
ids and offsets as the trunk's keys at j; a pool of ``[depths, 2, blocks, block size, heads,
head dim]`` carved out of the engine's memory budget, see :func:`mtp_cache_share`). A draft round
runs depth d over positions ``[c_d, V - 1]``, c_d = max(V_prev - d, 0) being the first position
depth d has not committed (V_prev: the verified length at the previous round). Those are the
positions verified since then (committed now) and the d positions that read drafts (written too,
then overwritten at the next round, whose range starts there: no draft ever reads a key computed
from a rejected token). A position that reads the sampled token is committed when it is written:
the sampled token is always kept, so depth 0 never runs a position twice. Depth d >= 1's input at
its first position comes from the previous round (a carry per request and depth, kept by request
id: depth d - 1's output there); every other input is this round's: the decoder's hidden states
of the step's accepted tokens, depth d - 1's outputs.

The layer itself is megatron's (``MultiTokenPredictionLayer.forward_single_position``, as in
:mod:`sequence_drafts`), over all requests' positions packed into one sequence, with its core
attention swapped for the duration of the call for :class:`CachedDepthAttention`: it writes the
positions' keys and values into the depth's cache and attends over the cache (the CPU paged
attention of :mod:`paged_attention`, which reads only the blocks in use). Positions past a
request's range are padding: their keys go to a scratch block and their outputs are never read;
on a CPU the layer skips them (:func:`_kept_positions`). The last depth's outputs are read at
each request's last position only, so its other positions run the layer only as far as their
keys and values (:meth:`IncrementalDrafts._keys_then_last`), or, where they are few, ride along in
the pass over the last positions, writing their keys without attending.

A draft costs (accepted tokens + d) positions of one MTP layer per depth and step, independent
of the sequence length but for attention's reads of the cache. Exact: every draft's logits equal
the sequence path's (tested within 1e-5 at every step, through rejections and across requests).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from nemo_rl_mtp.megatron_compat.controller_hooks import pad_rows
from nemo_rl_mtp.rollout.draft_rounds import DraftRoundsController, draft_embedding, mtp_layer, output_logits, sequence_parallel_multiple
from nemo_rl_mtp.megatron_compat.cpu.paged_attention import paged_attention_over_pairs

logger = logging.getLogger(__name__)

# On a CPU, the last depth's keys-only positions ride along in the pass over the last positions
# while their MLP's multiply-adds (hidden x ffn hidden per position) stay within this: a second
# pass costs megatron's modules again, about 0.5 ms of CPU, what some 250 positions of the MLP
# cost at hidden 64, ffn 256 (measured at 512 requests); half that, 128 positions there.
RIDE_ALONG_MULTIPLY_ADDS = 128 * 64 * 256


def mtp_self_attention(layer):
    """The self-attention module of an MTP layer's transformer layer, or None where the layer is
    not one transformer layer with a swappable core attention (hybrid MTP patterns, MLA)."""
    from megatron.core.transformer.attention import SelfAttention

    found = [module for module in layer.modules() if isinstance(module, SelfAttention)]
    if len(found) != 1 or not hasattr(found[0], "core_attention"):
        return None
    return found[0]


def unsupported_reason(model) -> str | None:
    """Why incremental drafts cannot serve this model (None: they can)."""
    if getattr(model, "mtp", None) is None:
        return None  # a pipeline stage without the MTP layers drafts nothing
    for layer in model.mtp.layers:
        attention = mtp_self_attention(layer)
        if attention is None:
            return "an MTP layer is not one transformer layer with self-attention"
        if attention.config.multi_latent_attention:
            return "MTP layers with multi-latent attention"
    return None


def mtp_cache_share(kv_layers: int, num_depths: int) -> float:
    """The MTP caches' share of the engine's KV memory: per block, each MTP depth stores what one
    attention layer stores (same heads and head size), so where the engine's context keeps keys
    and values for ``kv_layers`` layers of this pipeline stage, the D depths' caches get
    D / (kv_layers + D) of the budget and the engine the rest."""
    if num_depths == 0:
        return 0.0
    return num_depths / (kv_layers + num_depths)


class MTPKVCache:
    """Keys and values of each MTP depth's attention: ``[D, 2, blocks + 1, block size, heads, head
    dim]``, addressed by the engine's block ids (block ``blocks`` is scratch for padding).
    Allocated zeroed and written only with keys and values, so a slot a request has not written
    holds a finite number, which the attention's mask weighs exactly zero without zeroing it."""

    def __init__(self, attention, num_depths: int, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        heads = attention.num_query_groups_per_partition
        head_dim = attention.hidden_size_per_attention_head
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.buffer = torch.zeros(num_depths, 2, num_blocks + 1, block_size, heads, head_dim, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def slots(self, block_table: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Flat cache slots ``[R, W]`` of positions ``[R, W]`` of the requests whose block rows are
        ``block_table`` ``[R, max blocks]``; invalid positions go to the scratch block."""
        column = (positions // self.block_size).clamp(0, block_table.shape[1] - 1)
        blocks = block_table.gather(1, column).long()
        blocks = torch.where(valid & (blocks >= 0), blocks, self.scratch_block)
        return blocks * self.block_size + positions % self.block_size


class KeysWritten(Exception):
    """Raised by a keys-only :class:`CachedDepthAttention` once its keys and values are cached: it
    ends the layer's forward there (the output projection and the MLP would compute outputs no
    one reads), and :meth:`IncrementalDrafts._run_layer` catches it. Every tensor-parallel rank
    raises at the same point. Around the core attention megatron (0.17-0.19) opens only an
    activation-offloading context, inert outside training, and an nvtx range, which stays pushed
    (a no-op unless profiling): nothing of the model's state is left half-done."""


class CachedDepthAttention(torch.nn.Module):
    """Core attention of one MTP depth over its cache, for one draft round: queries, keys and
    values ``[R * W, 1, heads, head dim]`` of the packed positions (request-major); their keys and
    values are written at ``slots`` and each position attends causally over its request's keys
    0..position. Returns ``[R * W, 1, heads * head dim]``; ``keys_only``: raises
    :class:`KeysWritten` after writing instead. Where the layout's ``attending_rows`` is fewer than
    its rows, the rows after them only write their keys, and their outputs are zeros."""

    def __init__(self, cache: torch.Tensor, softmax_scale: float):
        super().__init__()
        self.cache, self.softmax_scale = cache, softmax_scale
        self.layout: dict = {}  # the call's (IncrementalDrafts._run_layer sets it and keys_only)
        self.keys_only = False

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        layout = self.layout
        rows, width = layout["slots"].shape
        kept = layout["kept"]  # None: every [R, W] position is a row; else the rows are these positions
        count = rows * width if kept is None else kept.numel()
        pairs = self.cache.view(2, -1, *self.cache.shape[3:])
        slots = layout["slots"].reshape(-1)
        pairs[:, slots if kept is None else slots[kept]] = torch.stack([key[:count, 0], value[:count, 0]]).to(pairs.dtype)
        if self.keys_only:
            raise KeysWritten
        attending = layout["attending_rows"]  # the grid's leading rows; the rest only wrote their keys
        queries = query[: attending * width, 0] if kept is None else query.new_zeros(rows * width, *query.shape[2:]).index_copy_(0, kept, query[:count, 0])
        attended = paged_attention_over_pairs(
            queries.reshape(attending, width, *query.shape[2:]), layout["query_lengths"], self.cache, layout["block_table"],
            layout["key_lengths"], self.softmax_scale, slots_hold_finite_values=True,  # MTPKVCache: zeroed, then written
        )  # fmt: skip
        attended = attended.reshape(attending * width, -1)
        output = (attended if kept is None else attended[kept]).reshape(-1, 1, attended.shape[-1])
        missing = query.shape[0] - output.shape[0]  # keys-only rows, and rows padded for sequence parallelism
        return torch.cat([output, output.new_zeros(missing, 1, output.shape[-1])]) if missing else output


class IncrementalDrafts:
    """Drafts from per-depth KV caches of the committed positions (module docstring)."""

    def __init__(self, model, context, num_depths: int):
        self.model = model
        self.num_depths = num_depths
        self.attentions = [mtp_self_attention(mtp_layer(model, depth)) for depth in range(num_depths)]
        parameter = next(model.parameters())
        self.cache = MTPKVCache(
            self.attentions[0], num_depths, context.kv_block_allocator.total_count, context.block_size_tokens,
            model.config.params_dtype, parameter.device,
        )
        # Built once: a module's construction costs about 50 us, a tenth of a batch-1 draft's layer.
        self.cores = [
            CachedDepthAttention(self.cache.buffer[depth], attention.core_attention.softmax_scale) for depth, attention in enumerate(self.attentions)
        ]
        self.ride_along_positions = RIDE_ALONG_MULTIPLY_ADDS // (model.config.hidden_size * model.config.ffn_hidden_size)
        self.rotary = None
        if model.position_embedding_type == "rope":
            self.rotary = model.rotary_pos_emb(context.max_sequence_length + num_depths + 1)
        self.carries = None
        self._round = None

    def reset(self, num_request_ids: int) -> None:
        """Before a rollout whose request ids are 0..num_request_ids - 1: no carries yet."""
        hidden_size = self.model.config.hidden_size
        self.carries = self.cache.buffer.new_zeros(num_request_ids, max(self.num_depths, 1), hidden_size)

    def start_round(self, context, last_accepted: torch.Tensor, hidden: torch.Tensor) -> None:
        """Lay out the round from the step: per active request, where its step's tokens start,
        how many were verified, and where each depth's range begins."""
        if self.carries is None:
            raise RuntimeError("incremental MTP drafts: reset(num_request_ids) before a rollout (RolloutEngine.generate does)")
        device = hidden.device
        active = slice(context.paused_request_count, context.total_request_count)
        num_tokens = hidden.shape[0]
        query_lengths = context.request_query_lengths[active].to(device)
        starts = query_lengths.cumsum(0) - query_lengths
        step_positions = context.token_to_pos_ids[:num_tokens].to(device)
        first_position = step_positions[starts]
        accepted = last_accepted.to(device) - starts + 1
        # Both read the engine's host-side bookkeeping (megatron keeps it on the host): no device sync.
        decode_only = context.is_decode_only()
        widest_step = self.num_depths + 1 if decode_only else int(context.request_query_lengths[active].max())
        blocks_in_use = int(context.request_kv_block_counts[active].max())
        width = widest_step  # depth d's range: the step's accepted positions and d before them
        columns = torch.arange(width + self.num_depths, device=device)
        tape_index = (starts[:, None] + columns[None, :]).clamp(max=num_tokens - 1)
        self._round = {
            "request_ids": context.request_ids[active].to(device).long(),
            "decode_only": decode_only,
            "hidden": hidden[:, 0],
            "starts": starts,
            "first_position": first_position,
            "verified": first_position + accepted,
            "accepted": accepted,
            "width": width,
            "block_table": context.request_to_kv_block_ids[active, :blocks_in_use].to(device),
            # The tokens from position first_position on: the step's, then the sampled token and drafts.
            "tape": context.token_to_input_ids[:num_tokens].to(device)[tape_index],
        }

    def end_round(self) -> None:
        self._round = None

    def draft_step(self, next_token_ids: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth ``depth`` over each request's range; ``next_token_ids`` [1, >= R] is the token at
        position V (the sampled token at depth 0, draft ``depth`` after). Returns the hidden states
        [R, 1, H] and logits [R, 1, V] at each request's last verified position V - 1."""
        state = self._round
        rows = torch.arange(state["verified"].shape[0], device=state["verified"].device)
        state["tape"][rows, state["accepted"] + depth] = next_token_ids[0, : rows.numel()].to(state["tape"].device)
        first, verified = state["first_position"], state["verified"]
        start = (first - depth).clamp(min=0)
        width = state["width"] + depth
        positions = start[:, None] + torch.arange(width, device=start.device)[None, :]
        valid = positions < verified[:, None]
        hidden = self._depth_inputs(depth, start, positions)
        tokens = state["tape"].gather(1, (positions + depth + 1 - first[:, None]).clamp(0, state["tape"].shape[1] - 1))
        last_column = verified - start - 1
        if self._splits(depth, positions.device):
            last = self._keys_then_last(depth, hidden, tokens, positions, valid, last_column)
            return last, output_logits(self.model, last)
        layout = self._layout(positions, valid, query_lengths=verified - start, kept=_kept_positions(valid))
        output = self._run_layer(depth, hidden, tokens, positions, layout)
        state["previous_start"], state["previous_output"] = start, output  # the next depth's inputs
        last = output[rows, last_column].unsqueeze(1)
        return last, output_logits(self.model, last)

    def _layout(self, positions: torch.Tensor, valid: torch.Tensor, query_lengths: torch.Tensor, kept: torch.Tensor | None) -> dict:
        """Where the layer's positions ``[R, W]`` write their keys and what they attend to; ``kept``:
        the positions the layer runs (:func:`_kept_positions` of ``valid``)."""
        state = self._round
        return {
            "slots": self.cache.slots(state["block_table"], positions, valid),
            "query_lengths": query_lengths,
            "key_lengths": state["verified"],
            "block_table": state["block_table"],
            "kept": kept,
            "attending_rows": positions.shape[0],
        }

    def _splits(self, depth: int, device: torch.device) -> bool:
        """Whether depth ``depth`` runs its keys-only positions apart from the last ones
        (:meth:`_keys_then_last`: a keys-only pass, or riding along where they are few): the last
        depth, whose outputs no later depth reads, in a round with prefill requests (their whole
        prompts), and on a CPU in every round. On a GPU a decode round's few positions per request
        cost less than a second pass's kernel launches."""
        return depth == self.num_depths - 1 and (not self._round["decode_only"] or _on_cpu(device))

    def _keys_then_last(
        self, depth: int, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, last_column: torch.Tensor
    ) -> torch.Tensor:
        """The last depth (:meth:`_splits`): the round reads only each request's output at its
        last position, so the positions before it need only their keys and values in the cache.
        A keys-only pass (megatron's layer up to its core attention, :class:`KeysWritten`) writes
        them, then the whole layer runs on the last position of each request, attending over
        them. At 512 prompts the MLP, the output projection and the attention of all but 512
        positions are not computed: the prefill round's MTP layer at k = 1 took 82 -> 26 ms of
        CPU. Where they are few (``ride_along_positions``, :data:`RIDE_ALONG_MULTIPLY_ADDS`) they
        ride along in the pass over the last positions instead, after its R rows: they write
        their keys, do not attend, and their outputs, never read, cost a few rows of the MLP,
        where a second pass costs megatron's modules again. Returns the hidden states ``[R, 1,
        H]`` at the last positions."""
        state = self._round
        requests, width = positions.shape
        before_last = valid & (positions < state["verified"][:, None] - 1)
        keys_kept = _kept_positions(before_last)
        rows = torch.arange(requests, device=positions.device)

        def at_last(tensor: torch.Tensor) -> torch.Tensor:
            return tensor[rows, last_column].unsqueeze(1)

        if keys_kept is not None and keys_kept.numel() <= self.ride_along_positions:  # none (every draft rejected): the last pass alone

            def with_keys(tensor: torch.Tensor) -> torch.Tensor:
                return torch.cat([at_last(tensor)[:, 0], tensor.reshape(requests * width, *tensor.shape[2:])[keys_kept]])[:, None]

            grid = self._layout(positions, torch.ones_like(valid), query_lengths=torch.ones_like(last_column), kept=None)
            layout = grid | {"slots": with_keys(grid["slots"]), "attending_rows": requests}
            return self._run_layer(depth, with_keys(hidden), with_keys(tokens), with_keys(positions), layout)[:requests]
        keys_layout = self._layout(positions, before_last, query_lengths=state["verified"], kept=keys_kept)  # query lengths: unread
        self._run_layer(depth, hidden, tokens, positions, keys_layout, keys_only=True)
        last_positions = at_last(positions)
        every = torch.ones_like(last_positions, dtype=torch.bool)
        layout = self._layout(last_positions, every, query_lengths=torch.ones_like(last_column), kept=None)  # every position in range
        return self._run_layer(depth, at_last(hidden), at_last(tokens), last_positions, layout)

    def _depth_inputs(self, depth: int, start: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[R, W, H]: depth ``depth``'s input hidden state at each position of its range: the
        decoder's hidden states of the step at depth 0 (its range starts at the step's first
        position: nothing carried); after, the carry at the one position the previous depth does
        not cover, else that depth's output."""
        state = self._round
        if depth == 0:
            index = (state["starts"][:, None] + positions - state["first_position"][:, None]).clamp(0, state["hidden"].shape[0] - 1)
            return state["hidden"][index]
        ids = state["request_ids"]
        covered_from = state["previous_start"]
        index = (positions - covered_from[:, None]).clamp(0, state["previous_output"].shape[1] - 1)
        fresh = state["previous_output"].gather(1, index[..., None].expand(-1, -1, state["previous_output"].shape[2]))
        carried = positions < covered_from[:, None]
        inputs = torch.where(carried[..., None], self.carries[ids, depth][:, None, :], fresh)
        # The next round's carry for this depth: its input at position V - depth.
        self.carries[ids, depth] = self._next_carry(depth)
        return inputs

    def _next_carry(self, depth: int) -> torch.Tensor:
        """Depth ``depth`` (>= 1)'s input at position V - depth: depth - 1's output there."""
        state = self._round
        column = (state["verified"] - depth - state["previous_start"]).clamp(0, state["previous_output"].shape[1] - 1)
        return state["previous_output"][torch.arange(column.numel(), device=column.device), column]

    def _run_layer(
        self, depth: int, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, layout: dict, keys_only: bool = False
    ) -> torch.Tensor | None:
        """megatron's MTP layer for ``depth`` over the packed positions [R, W] (hidden [R, W, H]),
        the token embedding zeroed at position 0 where the model's MTP layers zero it (padding
        sits at position 0 too: its outputs are never read); returns its output [R, W, H], or
        with ``keys_only`` stops once the positions' keys and values are cached (returns None)."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region

        model = self.model
        rows, width, hidden_size = hidden.shape
        kept = layout["kept"]
        hidden, positions, tokens = hidden.reshape(-1, hidden_size), positions.reshape(-1), tokens.reshape(-1)
        if kept is not None:
            hidden, positions, tokens = hidden[kept], positions[kept], tokens[kept]
        count = positions.numel()
        padded = -(-count // sequence_parallel_multiple(model)) * sequence_parallel_multiple(model)
        packed = pad_rows(hidden[:, None, :], padded)
        flat_positions = pad_rows(positions, padded)
        token_ids = pad_rows(tokens, padded)[None, :]
        rotary = self.rotary[flat_positions.clamp(max=self.rotary.shape[0] - 1)] if self.rotary is not None else None
        embedding_positions = (flat_positions + depth + 1).clamp(max=model.max_sequence_length - 1)[None, :]
        if model.config.sequence_parallel:
            packed = scatter_to_sequence_parallel_region(packed)
        core = self.cores[depth]
        core.layout, core.keys_only = layout, keys_only
        with _swapped_core_attention(self.attentions[depth], core):
            try:
                output = mtp_layer(model, depth).forward_single_position(
                    hidden_states=packed,
                    next_token_ids=token_ids,
                    position_ids=embedding_positions,
                    embedding=draft_embedding(model, flat_positions[None, :]),
                    rotary_pos_emb=rotary,
                )
            except KeysWritten:
                return None
        if model.config.sequence_parallel:
            output = gather_from_sequence_parallel_region(output)
        output = output[:count, 0]
        if kept is not None:  # positions left out read zeros (never read: module docstring)
            output = output.new_zeros(rows * width, hidden_size).index_copy_(0, kept, output)
        return output.reshape(rows, width, hidden_size)


def _kept_positions(valid: torch.Tensor) -> torch.Tensor | None:
    """The flat indices of the ``[R, W]`` positions that are in their request's range, for the
    layer to run on those alone; None (every position runs, padding included) off the CPU, or
    where every position is in range. On a CPU a padding position costs what a real one does: at
    k = 1 with a draft rejected, the second position of every such request. Finding them reads
    their count back to the host, which on a GPU would wait for the device at every depth, where
    padding rows cost next to nothing."""
    if not _on_cpu(valid.device):
        return None
    kept = valid.reshape(-1).nonzero().squeeze(1)
    return None if kept.numel() == valid.numel() else kept  # all in range: no index to apply


def _on_cpu(device: torch.device) -> bool:
    """Whether the drafts run on a CPU, where every position run costs its full compute and a
    host read costs nothing (on a GPU: the reverse)."""
    return device.type == "cpu"


@contextlib.contextmanager
def _swapped_core_attention(attention, core):
    """The attention module computes with ``core`` for the duration (megatron calls
    ``self.core_attention(query, key, value, mask, ...)`` after rotary embedding)."""
    original = attention.core_attention
    attention.core_attention = core
    try:
        yield
    finally:
        attention.core_attention = original


class IncrementalDraftsController(DraftRoundsController):
    """Draft rounds served by :class:`IncrementalDrafts` (a mixin: see :mod:`controllers`)."""

    drafter_class = IncrementalDrafts
