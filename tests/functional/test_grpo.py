"""GRPO end to end through ``examples/run_grpo.py``: real Ray workers, real megatron-core on CPU,
real JSONL / TensorBoard / offline wandb files."""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import pytest

from nemo_rl_mtp.reporting.logger import read_metrics
from nemo_rl_mtp.reporting.plot import plot_run
from tests.support.helpers import SMALL_GRPO_STEP, run_grpo
from tests.support.release_gates import RunsByName, command_refusal
from tests.support.engine_cases import requires_speculation
from tests.support.wandb_offline import offline_history

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]

SMALL = SMALL_GRPO_STEP
MOE_RECIPE = REPO_ROOT / "examples" / "configs" / "grpo_mtp_moe_tiny_cpu.yaml"
POLICY_MOVES_RECIPE = REPO_ROOT / "examples" / "configs" / "grpo_mtp_policy_moves_tiny_cpu.yaml"
STEPS = 3
HYBRID_MOE = [
    "--config", str(MOE_RECIPE), "policy.megatron_cfg.model_class=hybrid", "policy.megatron_cfg.num_layers=4",
    "policy.megatron_cfg.hybrid_layer_pattern='*E*E/*E'",
]  # fmt: skip
# Wall-clock dependent: not expected to agree between runs.
TIMING_KEYS = ("timing/", "rollout/tokens_per_s")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run each configuration once; tests inspect the results."""
    log_dir = tmp_path_factory.mktemp("logs")
    quiet = ["logger.wandb_enabled=false", "logger.tensorboard_enabled=false"]
    # The recipe's auto chooses the drafts per step from measured step times, and sampled rollouts
    # depend on k (its draws): runs compared with each other pin k.
    one_draft = ["policy.generation.num_speculative_tokens=1"]
    greedy = ["policy.generation.top_k=1", *one_draft, *quiet]
    configs = {
        # The default recipe (one MTP layer), speculating one draft token.
        "mtp1": one_draft,
        "mtp_off": ["policy.megatron_cfg.mtp_num_layers=0", "policy.generation.num_speculative_tokens=0", *quiet],
        "mtp1_tp2": ["cluster.workers_per_node=2", "policy.megatron_cfg.tensor_model_parallel_size=2", *one_draft, *quiet],
        # Two MTP layers drafting two tokens, at pipeline-parallel 2 (the MTP block on the last stage).
        "mtp2_pp2": [
            "cluster.workers_per_node=2",
            "policy.megatron_cfg.pipeline_model_parallel_size=2",
            "policy.megatron_cfg.mtp_num_layers=2",
            "policy.generation.num_speculative_tokens=2",
            *quiet,
        ],
        # Two optimizer steps per GRPO step (global batch of 16 out of 32 samples), with megatron's
        # own MTP loss (the default is total_variation, a loss on the policy's distribution); the
        # recipe's num_speculative_tokens: auto.
        "two_optimizer_steps_cross_entropy": [
            "policy.train_global_batch_size=16", "policy.megatron_cfg.mtp_loss_type=cross_entropy", *quiet,
        ],  # fmt: skip
        # The tiny MoE recipe (MoE trunk and MTP layer), on one worker and on two data-parallel ones.
        # Sampled rollouts depend on how prompts are batched (one generator per engine), so the
        # data-parallel layouts are compared on greedy rollouts. (The dense trunk at data-parallel 2
        # is compared with one worker end to end by test_fault_injection's DP2 -> DP1 resume.)
        "moe_greedy": ["--config", str(MOE_RECIPE), *greedy],
        "moe_greedy_dp2": ["--config", str(MOE_RECIPE), "cluster.workers_per_node=2", *greedy],
        # The recipe in which RL moves the policy (a mixed warm start, KL to the start of RL logged),
        # with the heads frozen for the GRPO steps.
        "moves_frozen": [
            "--config", str(POLICY_MOVES_RECIPE), "grpo.warmup_imitation_steps=2", "policy.mtp_frozen_during_rl=true", *quiet,
        ],  # fmt: skip
        # model_class=hybrid: the MoE recipe as a HybridModel (attention, MoE; the MTP layer likewise),
        # sampled rollouts drafting one token; a checkpoint after its next-to-last step too.
        "hybrid_moe": [*HYBRID_MOE, *one_draft, *quiet, f"checkpointing.save_period={STEPS - 1}"],
    }
    import ray

    from nemo_rl_mtp.cluster.ray_cluster import init_ray
    from nemo_rl_mtp.config.load import load_config

    init_ray(load_config().cluster)  # one local instance for every run of this module
    try:  # stopped whatever happens: a failed run must not leave it to the next module's tests
        results = RunsByName()  # a run the installed release refuses skips the tests that read it
        for name, overrides in configs.items():
            argv = [*SMALL, f"grpo.max_num_steps={STEPS}", f"logger.log_dir={log_dir}", f"logger.run_name={name}", *overrides]
            refusal = command_refusal(argv)
            if refusal is not None:
                results.refused[name] = refusal
                continue
            assert run_grpo(argv) == 0, name
            results[name] = log_dir / name
        # The hybrid run resumed from its next-to-last step's checkpoint: its run directory copied
        # without the final checkpoint (as if the run had died after the step's metrics but
        # before saving it), then run again under the copy's name.
        if "hybrid_moe" in results.refused:
            results.refused["hybrid_moe_resumed"] = results.refused["hybrid_moe"]
        else:
            resumed = log_dir / "hybrid_moe_resumed"
            shutil.copytree(log_dir / "hybrid_moe", resumed)
            shutil.rmtree(resumed / "checkpoints" / f"step_{STEPS:06d}")
            argv = [*SMALL, f"grpo.max_num_steps={STEPS}", f"logger.log_dir={log_dir}", "logger.run_name=hybrid_moe_resumed", *configs["hybrid_moe"]]
            with ResumeLog() as resume_log:
                assert run_grpo(argv) == 0, "hybrid_moe_resumed"
            assert f"from {resumed / 'checkpoints' / f'step_{STEPS - 1:06d}'} ({STEPS - 1} steps done)" in resume_log.text
            results["hybrid_moe_resumed"] = resumed
        yield results
    finally:
        ray.shutdown()


class ResumeLog(logging.Handler):
    """The run module's log lines while in use (a module-scoped fixture has no ``caplog``)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.text = ""
        self.logger = logging.getLogger("nemo_rl_mtp.grpo.run")

    def emit(self, record: logging.LogRecord) -> None:
        self.text += record.getMessage() + "\n"

    def __enter__(self) -> "ResumeLog":
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


def _mtp_keys(row: dict) -> set[str]:
    return {key for key in row if key.startswith("train/mtp/")}


@pytest.mark.parametrize("name, layers", [("mtp1", 1), ("mtp2_pp2", 2), ("hybrid_moe", 1)])
def test_mtp_metrics_logged_every_step(runs, name, layers):
    rows = read_metrics(runs[name] / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(STEPS))
    expected = {"train/mtp/grad_norm", "train/mtp/global_valid_tokens"}
    for layer in range(1, layers + 1):
        expected |= {f"train/mtp/mtp_{layer}_{name}" for name in ("loss", "acceptance_rate", "target_tokens", "expected_acceptance")}
    for row in rows:
        assert _mtp_keys(row) == expected
        assert all(row[f"train/mtp/mtp_{layer}_target_tokens"] > 0 for layer in range(1, layers + 1))
        assert all(math.isfinite(row[key]) for key in row)
        assert row["train/mtp/grad_norm"] > 0 and row["train/mtp/mtp_1_loss"] > 0
        for key in ("train/reward", "train/loss", "train/clip_fraction", "rollout/tokens_per_s", "timing/step_s"):
            assert key in row
        # Generation and training agree on every sampled token's logprob.
        assert row["train/generation_logprob_error"] < 1e-4


def test_pipeline_parallel_two_reports_mtp_metrics_from_the_last_stage(runs):
    """Under PP the MTP block lives on the last stage; its metrics reach the driver every step.
    (Initial weights depend on the pipeline layout, so values are not compared with PP1.)"""
    rows = read_metrics(runs["mtp2_pp2"] / "metrics.jsonl")
    assert len(rows) == STEPS
    for row in rows:
        assert {"train/mtp/mtp_1_loss", "train/mtp/mtp_2_acceptance_rate", "train/mtp/grad_norm"} <= set(row)
        assert all(math.isfinite(value) for value in row.values())
        assert row["train/mtp/grad_norm"] > 0 and row["train/generation_logprob_error"] < 1e-4


def test_mtp_off_logs_no_mtp_metrics(runs):
    rows = read_metrics(runs["mtp_off"] / "metrics.jsonl")
    assert len(rows) == STEPS
    assert all(not _mtp_keys(row) for row in rows)
    assert all(math.isfinite(row["train/reward"]) for row in rows)


def test_wandb_offline_run_holds_the_mtp_series(runs):
    run_files = list((runs["mtp1"] / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    history = offline_history(run_files[0])
    jsonl = read_metrics(runs["mtp1"] / "metrics.jsonl")
    for key in ("train/mtp/mtp_1_loss", "train/mtp/mtp_1_acceptance_rate", "train/mtp/grad_norm", "train/reward"):
        series = [row[key] for row in history if key in row]
        assert len(series) == STEPS, key
        assert series == pytest.approx([row[key] for row in jsonl]), key


def test_two_optimizer_steps_per_grpo_step_train_the_second_half_off_policy(runs):
    """One optimizer step per GRPO step is on-policy: every probability ratio is 1. With two, the
    second half of the samples meets weights the first step changed."""
    for row in read_metrics(runs["mtp1"] / "metrics.jsonl"):
        assert row["train/optimizer_steps"] == 1 and row["train/probs_ratio"] == pytest.approx(1.0, abs=1e-6)
    for row in read_metrics(runs["two_optimizer_steps_cross_entropy"] / "metrics.jsonl"):
        assert row["train/optimizer_steps"] == 2
        assert abs(row["train/probs_ratio"] - 1.0) > 1e-5
        assert row["train/mtp/mtp_1_loss"] > 0 and row["train/mtp/grad_norm"] > 0


@requires_speculation  # without it, auto chooses 0 once, at config load (test_adaptive_speculation)
def test_auto_logs_its_choice_and_the_tokens_per_second_behind_it(runs):
    """The recipe's num_speculative_tokens: auto, on one MTP layer: k in {0, 1} every step, drafts
    counted exactly when it speculates."""
    for row in read_metrics(runs["two_optimizer_steps_cross_entropy"] / "metrics.jsonl"):
        k = row["rollout/num_speculative_tokens"]
        assert k in (0.0, 1.0)
        assert row["rollout/expected_tokens_per_s"] > 0 and row["rollout/engine_tokens_per_s"] > 0
        assert ("rollout/draft_1_proposed" in row) == (k == 1.0)


@pytest.mark.parametrize("name", ["moe_greedy", "hybrid_moe"])
def test_moe_recipe_trains_the_mtp_head_and_logs_the_router_loss(runs, name):
    for row in read_metrics(runs[name] / "metrics.jsonl"):
        assert row["train/moe/load_balancing_loss"] > 0
        assert row["train/mtp/mtp_1_loss"] > 0 and row["train/mtp/grad_norm"] > 0


def test_a_hybrid_run_resumed_from_its_checkpoint_gives_the_uninterrupted_metrics(runs):
    """model_class=hybrid through a checkpoint: weights, optimizer, RNG and sampler come back (the
    first half validates once more at its end, so validation is left out of the comparison)."""
    ignored = (*TIMING_KEYS, "val/")
    rows = [read_metrics(runs[name] / "metrics.jsonl") for name in ("hybrid_moe", "hybrid_moe_resumed")]
    comparable = [[{key: value for key, value in row.items() if not key.startswith(ignored)} for row in run] for run in rows]
    assert [row["step"] for row in rows[1]] == list(range(STEPS))
    assert comparable[1] == comparable[0]


def test_frozen_heads_log_their_metrics_and_get_no_gradient_while_the_policy_moves(runs):
    """KL to the start of RL: 0 at the first step (its rollouts come from the start policy), then
    positive; the heads get no gradient but their loss, acceptance and forecast are logged."""
    rows = read_metrics(runs["moves_frozen"] / "metrics.jsonl")
    assert rows[0]["train/kl_to_start"] == 0.0
    assert all(row["train/kl_to_start"] > 0 for row in rows[1:])
    for row in rows:
        assert row["train/mtp/grad_norm"] == 0.0 and row["train/entropy"] > 0
        assert row["train/mtp/mtp_1_loss"] > 0 and row["train/mtp/mtp_1_expected_acceptance"] > 0
        assert row["rollout/draft_1_proposed"] > 0
    assert (runs["moves_frozen"] / "checkpoints" / "start_of_rl").is_dir()


@pytest.mark.parametrize("name, bounded", [("mtp1", True), ("two_optimizer_steps_cross_entropy", False)])
def test_both_kinds_of_mtp_loss_train_the_heads(runs, name, bounded):
    """total_variation (the default) is a probability, in [0, 1]; cross entropy is not bounded."""
    for row in read_metrics(runs[name] / "metrics.jsonl"):
        assert 0 < row["train/mtp/mtp_1_loss"] and (row["train/mtp/mtp_1_loss"] < 1 or not bounded)
        assert row["train/mtp/grad_norm"] > 0 and 0 < row["train/mtp/mtp_1_expected_acceptance"] < 100
        assert "train/kl_to_start" not in row


def test_tensorboard_events_written(runs):
    assert list((runs["mtp1"] / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("one, two", [("mtp1", "mtp1_tp2"), ("moe_greedy", "moe_greedy_dp2")])
def test_data_and_tensor_parallel_two_give_the_same_metrics_as_one_worker(runs, one, two):
    """Same global batch, same initial weights (TP splits the same initial matrices), same draws."""
    one = read_metrics(runs[one] / "metrics.jsonl")
    two = read_metrics(runs[two] / "metrics.jsonl")
    assert len(one) == len(two) == STEPS
    for step_one, step_two in zip(one, two):
        assert step_one.keys() == step_two.keys()
        for key, value in step_one.items():
            if not key.startswith(TIMING_KEYS):
                assert step_two[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step_one["step"], key)


@pytest.mark.parametrize("name, drafts", [("mtp1", 1), ("mtp2_pp2", 2)])
def test_rollout_acceptance_logged_per_draft_position(runs, name, drafts):
    for row in read_metrics(runs[name] / "metrics.jsonl"):
        accepted_before = math.inf
        for position in range(1, drafts + 1):
            proposed, accepted = row[f"rollout/draft_{position}_proposed"], row[f"rollout/draft_{position}_accepted"]
            assert 0 < proposed and 0 <= accepted <= min(proposed, accepted_before)
            assert row[f"rollout/draft_{position}_acceptance_rate"] == pytest.approx(100 * accepted / proposed)
            accepted_before = accepted  # a draft counts only when the drafts before it were accepted
        assert f"rollout/draft_{drafts + 1}_proposed" not in row
        assert 1.0 <= row["rollout/tokens_per_decode_step"] <= 1 + drafts
        assert row["rollout/decode_steps"] >= 1 and row["rollout/tokens_per_s"] > 0


def test_no_rollout_acceptance_without_speculation(runs):
    for row in read_metrics(runs["mtp_off"] / "metrics.jsonl"):
        assert not [key for key in row if key.startswith("rollout/draft_")]
        assert row["rollout/decode_steps"] >= 1


def test_plot_of_a_run(runs, tmp_path):
    output = plot_run(runs["mtp2_pp2"] / "metrics.jsonl", tmp_path / "run.png")
    import matplotlib.image

    image = matplotlib.image.imread(output)
    assert image.shape[0] > 200 and image.shape[1] > 600


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["policy.megatron_cfg.mtp_num_layerz=2"], "mtp_num_layerz"),
        (["policy.generation.num_speculative_tokens=-1"], "policy.generation.num_speculative_tokens=-1"),
        pytest.param(["policy.megatron_cfg.mtp_num_layers=0", "policy.generation.num_speculative_tokens=1"], "mtp_num_layers > 0", marks=requires_speculation),
        pytest.param(["policy.megatron_cfg.mtp_num_layers=1", "policy.generation.num_speculative_tokens=2"], "at most 1 draft", marks=requires_speculation),
        (["cluster.cpus_per_worker=4096"], "cluster.workers_per_node=1: needs 4096 CPUs"),
        (["logger.log_dir=/proc/nemo_rl_mtp_logs"], "logger.log_dir=/proc/nemo_rl_mtp_logs: not writable"),
        (
            [*HYBRID_MOE[2:4], "policy.megatron_cfg.hybrid_layer_pattern='M*M-/*-'"],
            "policy.megatron_cfg.hybrid_layer_pattern='M*M-/*-': Mamba (mamba_ssm, causal-conv1d) layers need CUDA kernels",
        ),
    ],
)
def test_bad_config_is_rejected_before_any_worker(overrides, named, capsys):
    assert run_grpo(overrides) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(
    "recipe", ["grpo_mtp_deepseek_v3_style_gpu.yaml", "grpo_mtp_nemotron3_super_style_gpu.yaml", "grpo_mtp_nemotron3_super_style_hybrid_gpu.yaml"]
)
def test_gpu_recipes_load_and_are_refused_without_gpus(recipe, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    argv = ["--config", str(REPO_ROOT / "examples" / "configs" / recipe)]
    refusal = command_refusal(argv)  # what the installed release lacks comes first
    if refusal is not None:
        pytest.skip(refusal)
    assert run_grpo(argv) == 2
    assert "GPU recipe" in capsys.readouterr().err
