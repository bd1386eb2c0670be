from __future__ import annotations

import pytest
import torch

from nemo_rl_mtp.grpo.loop import build_train_batch, group_advantages
from nemo_rl_mtp.training.losses import ClippedPGLossFn


def test_group_advantages_are_centred_and_scaled_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2])
    normalised = group_advantages(rewards, group_size=4, normalize=True).view(2, 4)
    assert torch.allclose(normalised.mean(dim=1), torch.zeros(2), atol=1e-6)
    assert normalised[0].std() == pytest.approx(1.0, rel=1e-4)
    assert torch.equal(normalised[1], torch.zeros(4))  # no signal in a constant group
    centred = group_advantages(rewards, group_size=4, normalize=False).view(2, 4)
    assert torch.allclose(centred[0], torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_train_batch_trains_response_tokens_including_end_of_sequence():
    generation = {
        "tokens": torch.tensor([[1, 5, 3, 7, 2, 0], [1, 6, 3, 9, 9, 2]]),
        "lengths": torch.tensor([5, 6]),
        "prompt_lengths": torch.tensor([3, 3]),
    }
    batch = build_train_batch(generation, torch.tensor([0.5, -0.5]), token_level_loss=True)
    assert batch["token_mask"].tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    assert batch["advantages"][0].unique().tolist() == [0.5]
    assert torch.equal(batch["sample_mask"], torch.ones(2))
    # Sequence level: each sample's 2 and 3 response tokens share one unit of weight.
    sequence_level = build_train_batch(generation, torch.tensor([0.5, -0.5]), token_level_loss=False)
    assert sequence_level["sample_mask"].tolist() == pytest.approx([1 / 2, 1 / 3])


def test_clipped_pg_loss_is_normalised_by_the_global_token_count():
    loss_fn = ClippedPGLossFn(ratio_clip_min=0.2, ratio_clip_max=0.2, reference_policy_kl_penalty=0.0)
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]])
    inputs = {
        "loss_mask": torch.tensor([[1.0, 1.0, 0.0]]),
        "advantages": torch.tensor([[1.0, 1.0, 1.0]]),
        "prev_logprobs": logprobs.clone(),
    }
    loss, metrics = loss_fn(logprobs, inputs, torch.tensor(4.0))
    # ratio 1: loss = -sum(advantage * mask) / G
    assert loss.item() == pytest.approx(-2.0 / 4.0)
    assert metrics["clip_fraction"].item() == 0.0


def test_clipping_and_kl_penalty():
    loss_fn = ClippedPGLossFn(ratio_clip_min=0.2, ratio_clip_max=0.2, reference_policy_kl_penalty=0.5)
    logprobs = torch.log(torch.tensor([[2.0]]))  # ratio 2 against prev 0
    inputs = {
        "loss_mask": torch.ones(1, 1),
        "advantages": torch.ones(1, 1),
        "prev_logprobs": torch.zeros(1, 1),
        "reference_logprobs": torch.zeros(1, 1),
    }
    loss, metrics = loss_fn(logprobs, inputs, torch.tensor(1.0))
    log_ratio = -logprobs.item()
    kl = torch.exp(torch.tensor(log_ratio)) - log_ratio - 1
    assert loss.item() == pytest.approx(-1.2 + 0.5 * kl.item(), rel=1e-5)
    assert metrics["clip_fraction"].item() == 1.0
    assert metrics["kl"].item() == pytest.approx(kl.item(), rel=1e-5)


def test_a_resume_may_change_length_and_layout_but_not_what_is_trained(tmp_path):
    from omegaconf import OmegaConf

    from nemo_rl_mtp.grpo.run import check_resumable_config
    from nemo_rl_mtp.config.load import ConfigError, load_config

    saved = tmp_path / "config.yaml"
    OmegaConf.save(load_config(overrides=["logger.run_name=run"]), saved)
    check_resumable_config(saved, load_config(overrides=["logger.run_name=run", "grpo.max_num_steps=300", "cluster.workers_per_node=2"]))
    changed = load_config(overrides=["logger.run_name=run", "policy.megatron_cfg.optimizer.lr=2e-3", "env.task=sort"])
    with pytest.raises(ConfigError, match=r"env\.task: 'reverse' -> 'sort'; policy\.megatron_cfg\.optimizer\.lr: 0\.001 -> 0\.002\)"):
        check_resumable_config(saved, changed)


def test_a_run_saved_before_a_key_existed_resumes_at_its_default_and_not_at_another_value(tmp_path):
    from omegaconf import OmegaConf

    from nemo_rl_mtp.grpo.run import check_resumable_config
    from nemo_rl_mtp.config.load import ConfigError, load_config

    older = OmegaConf.to_container(load_config(overrides=["logger.run_name=run"]))
    del older["loss_fn"]["token_level_loss"]  # as a config saved before the key was added
    saved = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.create(older), saved)
    check_resumable_config(saved, load_config(overrides=["logger.run_name=run"]))
    with pytest.raises(ConfigError, match=r"loss_fn\.token_level_loss: True -> False"):
        check_resumable_config(saved, load_config(overrides=["logger.run_name=run", "loss_fn.token_level_loss=false"]))


def test_warm_start_tasks_mix_in_the_distractor_at_its_fraction():
    """Seeded: the distractor's share of 4000 demonstrations is within 4 standard errors of the
    fraction; without a distractor nothing is drawn (the prompt stream is that of earlier runs)."""
    from nemo_rl_mtp.tasks.demonstrations import prompt_demonstrations, warmup_tasks
    from nemo_rl_mtp.tasks.tokenizer import DigitTokenizer
    from nemo_rl_mtp.tasks.digit_tasks import DigitTaskPrompts
    from nemo_rl_mtp.config.load import load_config

    generator = torch.Generator().manual_seed(7)
    tasks = warmup_tasks("reverse", "sort", 0.7, 4000, generator)
    share = tasks.count("sort") / len(tasks)
    assert set(tasks) == {"reverse", "sort"}
    assert abs(share - 0.7) < 4 * (0.7 * 0.3 / len(tasks)) ** 0.5
    untouched = torch.Generator().manual_seed(7)
    assert warmup_tasks("reverse", None, 0.0, 10, untouched) == ["reverse"] * 10
    assert torch.equal(untouched.get_state(), torch.Generator().manual_seed(7).get_state())
    tokenizer = DigitTokenizer()
    prompts = DigitTaskPrompts(load_config(overrides=["env.task=reverse"]).env, tokenizer, seed=0)
    prompt = prompts.task_prompt([3, 1, 2])
    batch = prompt_demonstrations([prompts.answered_as(prompt, "reverse"), prompts.answered_as(prompt, "sort")], tokenizer.pad_id)
    answers = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["token_mask"])]
    assert answers == [tokenizer.encode_answer([2, 1, 3]), tokenizer.encode_answer([1, 2, 3])]
    assert prompts.answered_as(prompt, "reverse") == prompt  # the task's own answer: the prompt's demonstration


def _claim(log_dir: str) -> str:
    from pathlib import Path

    from nemo_rl_mtp.grpo.run import claim_run_name

    return claim_run_name(Path(log_dir), "grpo-20260101-120000")


def test_runs_started_in_the_same_second_claim_distinct_run_directories(tmp_path):
    """Eight processes claim a name at once (two default runs side by side start in one second)."""
    import multiprocessing

    from nemo_rl_mtp.grpo.run import claim_run_name

    # claim_run_name itself, not a function of this module: each new process imports only grpo.run.
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        names = pool.starmap(claim_run_name, [(tmp_path, "grpo-20260101-120000")] * 8)
    assert sorted(names) == sorted(["grpo-20260101-120000", *(f"grpo-20260101-120000-{n}" for n in range(2, 9))])
    assert all((tmp_path / name).is_dir() for name in names)


def test_an_unwritable_log_dir_leaves_the_name_unclaimed_for_the_preflight_to_report(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert _claim(str(blocker / "logs")) == "grpo-20260101-120000"


def test_a_claimed_run_name_is_given_back_only_by_a_run_that_wrote_nothing(tmp_path):
    """A run that fails after claiming its name (refused at preflight, interrupted) removes the
    empty directory it claimed; one that wrote into it keeps it; a name the user chose is left."""
    from nemo_rl_mtp.config.load import ConfigError, load_config
    from nemo_rl_mtp.grpo.run import run_directory, run_named

    cfg = load_config(overrides=[f"logger.log_dir={tmp_path}"])
    with pytest.raises(ConfigError):
        with run_named(cfg) as named:
            assert run_directory(named.logger).is_dir()
            raise ConfigError("refused")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyboardInterrupt):
        with run_named(cfg) as named:
            (run_directory(named.logger) / "metrics.jsonl").write_text("{}\n")
            raise KeyboardInterrupt
    assert [path.name for path in tmp_path.iterdir()] == [named.logger.run_name]
    assert (run_directory(named.logger) / "metrics.jsonl").read_text() == "{}\n"
    (tmp_path / "mine").mkdir()
    with pytest.raises(ConfigError):
        with run_named(load_config(overrides=[f"logger.log_dir={tmp_path}", "logger.run_name=mine"])):
            raise ConfigError("refused")
    assert (tmp_path / "mine").is_dir()
