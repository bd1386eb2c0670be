"""The metric keys as dashboards and saved metrics.jsonl files know them (written out by hand here,
never built with the module's own rule), read back from keys, and the data-parallel merge of
rank results by their declared reductions against hand-written references."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_mtp import metrics
from nemo_rl_mtp.metrics import (
    DRAFT_ACCEPTANCE_RATE,
    MTP,
    MTP_EXPECTED_ACCEPTANCE,
    MTP_LOSS,
    MTP_TARGET_TOKENS,
    RANK_RESULT_REDUCTIONS,
    ROLLOUT,
    Reduction,
    UndeclaredMetricError,
    merge_data_parallel,
    reduce_over_ranks,
)


def test_keys_are_spelled_as_saved_runs_have_them():
    assert MTP_LOSS.key(1) == "mtp_1_loss"
    assert MTP_TARGET_TOKENS.key(3) == "mtp_3_target_tokens"
    assert MTP_EXPECTED_ACCEPTANCE.under(MTP).key(2) == "mtp/mtp_2_expected_acceptance"
    assert metrics.MTP_EXPECTED_ACCEPTANCE_SUM.under(MTP).key(1) == "mtp/mtp_1_expected_acceptance_sum"
    assert metrics.TRAIN_MTP_LOSS.key(2) == "train/mtp/mtp_2_loss"
    assert metrics.TRAIN_MTP_ACCEPTANCE_RATE.key(1) == "train/mtp/mtp_1_acceptance_rate"
    assert metrics.TRAIN_MTP_EXPECTED_ACCEPTANCE.key(1) == "train/mtp/mtp_1_expected_acceptance"
    assert metrics.ROLLOUT_DRAFT_ACCEPTANCE_RATE.key(2) == "rollout/draft_2_acceptance_rate"
    assert metrics.VALIDATION_DRAFT_ACCEPTANCE_RATE.key(1) == "val/draft_1_acceptance_rate"
    assert metrics.DRAFT_PROPOSED.under(ROLLOUT).key(1) == "rollout/draft_1_proposed"
    assert metrics.in_scope(metrics.TIMING, metrics.STEP_SECONDS) == "timing/step_s"
    assert metrics.in_scope(metrics.ROLLOUT, metrics.TOKENS_PER_DECODE_STEP) == "rollout/tokens_per_decode_step"
    assert metrics.MTP_GRAD_NORM == "mtp/grad_norm"
    assert metrics.all_in_scope(metrics.TRAIN, {"loss": 1.0, "mtp/mtp_1_loss": 2.0}) == {"train/loss": 1.0, "train/mtp/mtp_1_loss": 2.0}


def test_a_family_reads_back_its_own_keys_only():
    logged_loss = MTP_LOSS.under("train/", "mtp/")
    assert logged_loss.index("train/mtp/mtp_12_loss") == 12
    # Controls: another family, another scope, no number, a suffix that only starts alike.
    assert logged_loss.index("train/mtp/mtp_1_acceptance_rate") is None
    assert logged_loss.index("mtp/mtp_1_loss") is None
    assert logged_loss.index("train/mtp/mtp__loss") is None
    assert logged_loss.index("train/mtp/mtp_x_loss") is None
    assert MTP_EXPECTED_ACCEPTANCE.index("mtp_1_expected_acceptance_sum") is None
    assert DRAFT_ACCEPTANCE_RATE.under("rollout/").indices(
        ["rollout/draft_2_acceptance_rate", "rollout/draft_1_acceptance_rate", "val/draft_3_acceptance_rate", "rollout/draft_2_proposed"]
    ) == [1, 2]


def test_moving_a_key_between_scopes_refuses_one_from_elsewhere():
    assert metrics.moved_to_scope("rollout/draft_1_acceptance_rate", "rollout/", "val/") == "val/draft_1_acceptance_rate"
    with pytest.raises(ValueError, match="train/loss"):
        metrics.moved_to_scope("train/loss", "rollout/", "val/")


def test_an_undeclared_rank_result_is_refused_naming_it():
    declared = {"decode_steps": torch.tensor(3)}
    assert merge_data_parallel([declared, {"decode_steps": torch.tensor(5)}]) == {"decode_steps": torch.tensor(5)}  # control
    with pytest.raises(UndeclaredMetricError, match="'new_count'"):
        merge_data_parallel([{**declared, "new_count": torch.tensor(1)}, {**declared, "new_count": torch.tensor(2)}])


@pytest.mark.parametrize(
    "reduction, rank_0, rank_1, expected",
    [
        (Reduction.SUM, torch.tensor([4, 2]), torch.tensor([6, 1]), torch.tensor([10, 3])),
        (Reduction.SUM_BY_POSITION, torch.tensor([4, 2]), torch.tensor([6]), torch.tensor([10, 2])),
        (Reduction.SUM_BY_POSITION, torch.tensor([], dtype=torch.int64), torch.tensor([3, 1]), torch.tensor([3, 1])),
        (Reduction.MEAN, torch.tensor([1.0, 4.0]), torch.tensor([3.0, 0.0]), torch.tensor([2.0, 2.0])),
        (Reduction.MAX, torch.tensor(7), torch.tensor(9), torch.tensor(9)),
        (Reduction.SAME, torch.tensor([2, 5]), torch.tensor([2, 5]), torch.tensor([2, 5])),
        (Reduction.CONCATENATE, torch.tensor([3, 4]), torch.tensor([5]), torch.tensor([3, 4, 5])),
        (
            Reduction.CONCATENATE,
            torch.tensor([[1, 2, 3]]),
            torch.tensor([[4], [5]]),
            torch.tensor([[1, 2, 3], [4, -1, -1], [5, -1, -1]]),
        ),
    ],
)
def test_each_reduction_merges_two_ranks_as_written_out(reduction, rank_0, rank_1, expected):
    merged = reduce_over_ranks("some_result", reduction, [rank_0, rank_1], pad_value=-1)
    assert torch.equal(merged, expected)


def test_same_on_every_rank_refuses_ranks_that_differ():
    with pytest.raises(ValueError, match="'some_result'"):
        reduce_over_ranks("some_result", Reduction.SAME, [torch.tensor(1), torch.tensor(2)])


def test_rollouts_of_two_ranks_merge_as_policy_generate_needs():
    """Per-sample tensors in rank order (tokens padded with the pad id, logprobs with 0), the
    slowest rank's decode steps and auto's largest choice, counts and tokens/s summed (the draft
    counts by position: the ranks' autos chose different k, a failure CI caught in a two-node run)."""
    rank_0 = {
        "tokens": torch.tensor([[11, 12, 13]]),
        "lengths": torch.tensor([3]),
        "prompt_lengths": torch.tensor([1]),
        "logprobs": torch.tensor([[0.0, -0.5, -0.25]]),
        "decode_steps": torch.tensor(2),
        "draft_proposed": torch.tensor([2, 2]),
        "draft_accepted": torch.tensor([1, 0]),
        "speculative_tokens": torch.tensor(2),
        "expected_tokens_per_s": torch.tensor(10.0),
        "engine_tokens_per_s": torch.tensor(9.0),
    }
    rank_1 = {
        "tokens": torch.tensor([[21, 22]]),
        "lengths": torch.tensor([2]),
        "prompt_lengths": torch.tensor([1]),
        "logprobs": torch.tensor([[0.0, -1.0]]),
        "decode_steps": torch.tensor(1),
        "draft_proposed": torch.tensor([1]),  # its auto chose k = 1: it drafted one position
        "draft_accepted": torch.tensor([1]),
        "speculative_tokens": torch.tensor(1),
        "expected_tokens_per_s": torch.tensor(5.0),
        "engine_tokens_per_s": torch.tensor(6.0),
    }
    merged = merge_data_parallel([rank_0, rank_1], pad_values={"tokens": -7})
    expected = {
        "tokens": torch.tensor([[11, 12, 13], [21, 22, -7]]),
        "lengths": torch.tensor([3, 2]),
        "prompt_lengths": torch.tensor([1, 1]),
        "logprobs": torch.tensor([[0.0, -0.5, -0.25], [0.0, -1.0, 0.0]]),
        "decode_steps": torch.tensor(2),
        "draft_proposed": torch.tensor([3, 2]),
        "draft_accepted": torch.tensor([2, 0]),
        "speculative_tokens": torch.tensor(2),
        "expected_tokens_per_s": torch.tensor(15.0),
        "engine_tokens_per_s": torch.tensor(15.0),
    }
    assert merged.keys() == expected.keys() == RANK_RESULT_REDUCTIONS.keys()
    for key, value in expected.items():
        assert torch.equal(merged[key], value), key
