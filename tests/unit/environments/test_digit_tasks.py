from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from nemo_rl_mtp.data.tokenizer import DigitTokenizer
from nemo_rl_mtp.environments.digit_tasks import DigitTaskEnvironment, answer_reward, expected_answer


@pytest.mark.parametrize(
    "task, digits, answer",
    [("reverse", [3, 1, 4], [4, 1, 3]), ("sort", [3, 1, 4], [1, 3, 4]), ("count_up", [3, 9], [0, 1])],
)
def test_expected_answers(task, digits, answer):
    assert expected_answer(task, digits) == answer


def test_reward_gives_partial_credit_and_penalises_length():
    assert answer_reward([4, 1, 3], [4, 1, 3]) == 1.0
    assert answer_reward([4, 1, 3], [4, 0, 3]) == pytest.approx(2 / 3)
    assert answer_reward([4, 1, 3], [4, 1, 3, 3]) == pytest.approx(3 / 4)  # an extra token
    assert answer_reward([4, 1, 3], [4, 1]) == pytest.approx(2 / 3)  # a missing token
    assert answer_reward([4, 1, 3], []) == 0.0


def test_rewards_compare_answers_up_to_end_of_sequence():
    tokenizer = DigitTokenizer()
    env = DigitTaskEnvironment(OmegaConf.create({"task": "reverse", "min_digits": 2, "max_digits": 4}), tokenizer)
    answer = tokenizer.encode_answer([2, 1])  # "2 1 </s>"
    junk_after_eos = answer + [tokenizer.first_digit_id + 5]
    no_eos = answer[:-1]  # stopping is part of the answer
    bos_inside = [tokenizer.first_digit_id + 2, tokenizer.bos_id, tokenizer.eos_id]
    stops_early = [tokenizer.first_digit_id + 2, tokenizer.eos_id]
    rewards = env.rewards([[1, 2]] * 5, [answer, junk_after_eos, no_eos, bos_inside, stops_early])
    assert rewards == pytest.approx([1.0, 1.0, 2 / 3, 2 / 3, 1 / 3])


def test_prompts_respect_the_digit_range_and_the_seed():
    env = DigitTaskEnvironment(OmegaConf.create({"task": "sort", "min_digits": 2, "max_digits": 4}), DigitTokenizer())
    prompts = env.sample_prompts(200, torch.Generator().manual_seed(1))
    assert {len(prompt) for prompt in prompts} == {2, 3, 4}
    assert all(0 <= digit <= 9 for prompt in prompts for digit in prompt)
    assert prompts == env.sample_prompts(200, torch.Generator().manual_seed(1))


def test_training_prompts_never_include_a_validation_prompt():
    """Without the exclusion about 128 / 11100 of 20000 draws (about 230) would be held out."""
    from nemo_rl_mtp.utils.config import load_config

    env_cfg = load_config().env
    env = DigitTaskEnvironment(env_cfg, DigitTokenizer(), num_validation_prompts=128)
    held_out = {tuple(prompt) for prompt in env.validation_prompts}
    assert len(held_out) == 128
    assert DigitTaskEnvironment(env_cfg, DigitTokenizer(), 128).validation_prompts == env.validation_prompts  # fixed
    drawn = env.sample_prompts(20_000, torch.Generator().manual_seed(0))
    assert len(drawn) == 20_000 and not held_out & {tuple(prompt) for prompt in drawn}
    unfiltered = DigitTaskEnvironment(env_cfg, DigitTokenizer()).sample_prompts(20_000, torch.Generator().manual_seed(0))
    assert len(held_out & {tuple(prompt) for prompt in unfiltered}) > 50  # control: the draws do hit it
