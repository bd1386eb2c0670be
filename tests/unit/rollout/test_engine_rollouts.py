"""Rollouts on megatron-core's real DynamicInferenceEngine (CPU), with and without speculation by
the policy's own MTP heads."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl_mtp.training.imitation import IMITATION_LOSS, imitation_step
from nemo_rl_mtp.megatron_compat import engine_access
from nemo_rl_mtp.rollout.engine import RolloutEngine
from nemo_rl_mtp.rollout.speculation import speculation_metrics
from nemo_rl_mtp.training.logprobs import compute_logprobs
from nemo_rl_mtp.training.step import forward_backward_global_batch
from tests.support.helpers import VOCAB_SIZE, make_policy, recompute_sampler, response_mask, task_demonstrations, tiny_config
from tests.support.release_gates import on_this_release
from tests.support.engine_cases import PROMPTS, SIZES, TOKENIZER, drafts_where_possible, engine_overrides, requires_speculation
from tests.support.engine_cases import generate as _generate

pytestmark = pytest.mark.usefixtures("megatron_world")


def _policy(num_speculative_tokens: int, mtp_num_layers: int = 2, **overrides):
    policy, cfg = make_policy(**engine_overrides(num_speculative_tokens, mtp_num_layers, **overrides))
    return policy, cfg, RolloutEngine(policy, cfg)


def _inference_flag_active() -> bool:
    """megatron's InferenceMode flag (0.18 on); False where the release has none."""
    flag = engine_access.inference_mode_flag()
    return flag is not None and flag.is_active()


def _training_batch(rollouts):
    mask = response_mask(rollouts)
    return mask, {
        "input_ids": rollouts["tokens"],
        "input_lengths": rollouts["lengths"],
        "token_mask": mask.float(),
        "sample_mask": torch.ones(rollouts["tokens"].shape[0]),
    }

@pytest.mark.parametrize("num_speculative_tokens", [0, pytest.param(1, marks=requires_speculation), pytest.param(2, marks=requires_speculation)])
def test_greedy_rollouts_equal_a_full_forward_greedy_reference(num_speculative_tokens):
    """Same weights for every k (same seed); the reference recomputes the whole prefix per token."""
    policy, cfg, engine = _policy(num_speculative_tokens, generation__top_k=1)
    rollouts = _generate(engine)
    reference = recompute_sampler(policy, PROMPTS, cfg.generation.max_new_tokens, TOKENIZER.eos_id)
    assert [row[:length].tolist() for row, length in zip(rollouts["tokens"], rollouts["lengths"])] == reference
    if num_speculative_tokens:
        counts = rollouts["draft_proposed"]
        assert counts.shape == (num_speculative_tokens,) and counts[0] > 0


@requires_speculation
def test_greedy_rollouts_verified_by_rejection_sampling_are_exact_matchs_and_draw_nothing():
    """Greedy (top-k 1): p and q are point masses, so rejection sampling accepts a draft exactly
    when exact match does. Its rollouts take the argmax path: the same tokens, log-probs and
    acceptance counts as exact match, and the sampling generator left as seeded (nothing drawn).
    Control: at temperature 1 rejection sampling draws from that generator."""
    policy, _, _ = _policy(2)
    engines = {
        verification: RolloutEngine(policy, tiny_config(**engine_overrides(2, generation__spec_verification=verification)).policy)
        for verification in ("exact_match", "rejection_sampling")
    }
    greedy = {name: engine.generate(PROMPTS, TOKENIZER.eos_id, TOKENIZER.pad_id, seed=3, greedy=True) for name, engine in engines.items()}
    for key in ("tokens", "lengths", "logprobs", "draft_proposed", "draft_accepted"):
        assert torch.equal(greedy["rejection_sampling"][key], greedy["exact_match"][key]), key
    assert greedy["exact_match"]["draft_proposed"][0] > 0
    rejection = engines["rejection_sampling"]
    seeded = torch.Generator().manual_seed(3).get_state()
    assert torch.equal(rejection.engine.controller.sampling_rng.get_state(), seeded)
    rejection.generate(PROMPTS, TOKENIZER.eos_id, TOKENIZER.pad_id, seed=3)
    assert not torch.equal(rejection.engine.controller.sampling_rng.get_state(), seeded)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_rollout_logprobs_equal_training_logprobs(temperature, top_p):
    policy, cfg, engine = _policy(drafts_where_possible(2), generation__temperature=temperature, generation__top_p=top_p)
    rollouts = _generate(engine, seed=5)
    mask, batch = _training_batch(rollouts)
    training = compute_logprobs(policy, batch, cfg)
    assert mask.sum() > len(PROMPTS)
    torch.testing.assert_close(rollouts["logprobs"][mask], training[mask], rtol=0, atol=1e-5)
    again = _generate(engine, seed=5)
    assert torch.equal(again["tokens"], rollouts["tokens"])  # same seed, same rollouts


def test_ids_past_the_tokenizer_vocabulary_are_never_sampled():
    """The output layer holds 32 ids, the tokenizer 14: the rest must get no probability."""
    policy, _, engine = _policy(drafts_where_possible(1), generation__temperature=2.0)
    policy.vocab_size = TOKENIZER.vocab_size
    rollouts = _generate(engine, prompts=PROMPTS * 8, seed=1)
    generated = rollouts["tokens"][response_mask(rollouts)]
    assert generated.numel() > 300
    assert generated.max() < TOKENIZER.vocab_size


def test_next_rollout_uses_the_trained_weights_and_training_still_computes_the_mtp_loss():
    """No weight reload: the engine reads the live model. And generation leaves megatron's
    InferenceMode flag cleared and the model in train mode, so the MTP loss is still computed."""
    policy, cfg, engine = _policy(drafts_where_possible(1), generation__top_k=1)
    before = _generate(engine)
    assert not _inference_flag_active() and policy.model.training
    demonstrations = task_demonstrations("reverse", [[1, 2], [3, 4, 5], [6], [7, 8, 9, 0]] * 2, TOKENIZER)
    metrics = imitation_step(policy, demonstrations, cfg)
    assert metrics["mtp/mtp_1_loss"] > 0 and metrics["mtp/grad_norm"] > 0
    after = _generate(engine)
    reference = recompute_sampler(policy, PROMPTS, cfg.generation.max_new_tokens, TOKENIZER.eos_id)
    assert [row[:length].tolist() for row, length in zip(after["tokens"], after["lengths"])] == reference
    assert not torch.equal(after["logprobs"], before["logprobs"])


@pytest.mark.parametrize("flag_before", [False, True])
def test_rollouts_and_engine_builds_leave_the_flag_and_every_modules_mode_as_they_were(flag_before):
    """A model in eval mode with its MTP block in train mode (mixed, as a caller may hold it), and
    megatron's InferenceMode flag set or not: a rollout and an engine rebuild (``auto`` switching
    k) hand both back as they found them, not forced to train mode and a cleared flag."""
    flag = engine_access.inference_mode_flag()
    if flag_before and flag is None:
        pytest.skip(on_this_release("no InferenceMode flag (before 0.18: eval mode is the flag)"))
    k = drafts_where_possible(1)
    policy, _, engine = _policy(k)
    policy.model.eval()
    policy.model.module.mtp.train()
    modes = {name: module.training for name, module in policy.model.named_modules()}
    assert len(set(modes.values())) == 2
    if flag_before:
        flag.set_active()
    try:
        _generate(engine)
        assert {name: module.training for name, module in policy.model.named_modules()} == modes
        assert _inference_flag_active() == flag_before
        if k:  # an engine rebuild (where the engine speculates: to k = 0)
            engine.use_speculative_tokens(0)
            assert {name: module.training for name, module in policy.model.named_modules()} == modes
            assert _inference_flag_active() == flag_before
    finally:
        if flag is not None:
            flag.unset_active()
        policy.model.train()


@pytest.mark.parametrize("num_speculative_tokens", sorted({0, drafts_where_possible(1)}))  # one case where the engine cannot draft
@pytest.mark.parametrize("digits", [16, 22, 30])  # prompts of 18, 24, 32 tokens: room for 6, 0, no new tokens of 12
def test_a_prompt_without_room_for_its_response_is_refused_before_the_engine_sees_it(num_speculative_tokens, digits):
    """max_sequence_length 24, 12 new tokens. Without the check megatron-core 0.19.2 cut the first
    prompt's response to 6 tokens silently, failed with an IndexError on the second, refused the
    third with a warning."""
    _, _, engine = _policy(num_speculative_tokens, generation__top_k=1)
    fits = TOKENIZER.encode_prompt([1] * 10)  # 12 + 12 = 24 tokens: a control, at the boundary
    assert len(fits) + 12 == 24
    rollouts = _generate(engine, prompts=PROMPTS + [fits])
    assert int(rollouts["lengths"][-1]) <= 24
    prompt = TOKENIZER.encode_prompt([1] * digits)
    with pytest.raises(ValueError, match=rf"rollout prompt {len(PROMPTS)} has {len(prompt)} tokens: .*max_new_tokens=12 .* > the engine's 24"):
        _generate(engine, prompts=PROMPTS + [prompt])
    assert not _inference_flag_active()
    assert torch.equal(_generate(engine, seed=3)["tokens"], _generate(engine, seed=3)["tokens"])  # still usable


def test_forward_only_passes_run_no_mtp_layer():
    policy, cfg, engine = _policy(0, mtp_num_layers=1)
    calls = []
    hook = policy.model.module.mtp.register_forward_hook(lambda *args: calls.append(1))
    try:
        _, batch = _training_batch(_generate(engine))
        compute_logprobs(policy, batch, cfg)
        assert calls == []
        imitation_step(policy, task_demonstrations("reverse", [[1, 2], [3, 4]] * 4, TOKENIZER), cfg)
        assert calls  # control: the training forward does run it
    finally:
        hook.remove()


def _token_counts(rollouts, position: int) -> torch.Tensor:
    tokens = rollouts["tokens"]
    column = rollouts["prompt_lengths"] + position
    present = column < rollouts["lengths"]
    picked = tokens[present.nonzero().squeeze(1), column[present]]
    return torch.bincount(picked, minlength=VOCAB_SIZE)


def _chi_square_homogeneity(first: torch.Tensor, second: torch.Tensor) -> tuple[float, int]:
    """Two-sample chi-square statistic over the tokens seen at least 5 times in the pooled
    sample (rarer tokens pooled into one bin), and its degrees of freedom."""
    pooled = first + second
    common = pooled >= 5
    first = torch.cat([first[common], first[~common].sum().reshape(1)]).double()
    second = torch.cat([second[common], second[~common].sum().reshape(1)]).double()
    keep = (first + second) > 0
    first, second = first[keep], second[keep]
    n_first, n_second = first.sum(), second.sum()
    total = first + second
    expected_first, expected_second = total * n_first / (n_first + n_second), total * n_second / (n_first + n_second)
    statistic = ((first - expected_first) ** 2 / expected_first + (second - expected_second) ** 2 / expected_second).sum()
    return float(statistic), int(keep.sum()) - 1


def _chi_square_quantile(degrees_of_freedom: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at normal score ``z``."""
    k = degrees_of_freedom
    return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


SAME_PROMPT = [TOKENIZER.encode_prompt([3, 7])] * 400


def _engine(policy, k: int, **overrides) -> RolloutEngine:
    return RolloutEngine(policy, tiny_config(**engine_overrides(k, **SIZES, **overrides)).policy)


@requires_speculation
@pytest.mark.slow
@pytest.mark.parametrize(
    "verification, k, top_p",
    [("rejection_sampling", 2, 1.0), ("rejection_sampling", 1, 0.98), ("exact_match", 2, 1.0)],
)
def test_speculative_sampling_draws_the_same_token_distribution_as_plain_sampling(trained_policy, verification, k, top_p):
    """Temperature 1, heads trained until drafts are often accepted: per response position, the
    tokens drawn with k drafts and with none come from one distribution (two-sample chi-square
    test at significance 1e-3; the threshold follows from the number of token classes observed).
    Control: the same test tells temperature 0.6 from temperature 1."""
    speculating = _engine(trained_policy, k, generation__spec_verification=verification, generation__top_p=top_p)
    plain = _engine(trained_policy, 0, generation__top_p=top_p)
    colder = _engine(trained_policy, 0, generation__top_p=top_p, generation__temperature=0.6)
    with_drafts = _generate(speculating, SAME_PROMPT, seed=11)
    acceptance = speculation_metrics(with_drafts)["rollout/draft_1_acceptance_rate"]
    assert acceptance > 30, f"{acceptance:.0f}% of drafts accepted: too few for the test to bite"
    same, different = [], []
    for position in range(4):
        drafted = _token_counts(with_drafts, position)
        same.append(_chi_square_test(drafted, _token_counts(_generate(plain, SAME_PROMPT, seed=12), position)))
        different.append(_chi_square_test(drafted, _token_counts(_generate(colder, SAME_PROMPT, seed=13), position)))
    print(f"draft 1 acceptance {acceptance:.0f}%; k={k} vs k=0: {same}; vs temperature 0.6: {different}")
    assert all(passed for passed, _ in same), same
    assert not all(passed for passed, _ in different), different


@requires_speculation
@pytest.mark.slow
def test_rejection_sampling_accepts_more_drafts_than_exact_match_at_temperature_one(trained_policy):
    """Same heads, same prompts: acceptance sum min(p, q) against sum p q. The gap must exceed four
    standard errors of the difference of two proportions over the drafts proposed."""
    rates = {}
    for verification in ("exact_match", "rejection_sampling"):
        rollouts = _generate(_engine(trained_policy, 1, generation__spec_verification=verification), SAME_PROMPT * 2, seed=21)
        rates[verification] = (rollouts["draft_accepted"][0] / rollouts["draft_proposed"][0]).item(), rollouts["draft_proposed"][0].item()
    (exact, n_exact), (rejection, n_rejection) = rates["exact_match"], rates["rejection_sampling"]
    standard_error = math.sqrt(exact * (1 - exact) / n_exact + rejection * (1 - rejection) / n_rejection)
    print(f"draft acceptance: exact match {exact:.3f} ({n_exact:.0f} drafts), rejection sampling {rejection:.3f} ({n_rejection:.0f})")
    assert rejection - exact > 4 * standard_error


@requires_speculation
@pytest.mark.slow
def test_rejection_sampling_rollout_logprobs_are_the_policys(trained_policy):
    """Not the drafts': the training pass over the same tokens gives the same log-probs."""
    cfg = tiny_config(**engine_overrides(2, **SIZES, generation__temperature=0.8)).policy
    rollouts = _generate(RolloutEngine(trained_policy, cfg), SAME_PROMPT[:64], seed=4)
    assert rollouts["draft_accepted"].sum() > 0
    mask, batch = _training_batch(rollouts)
    training = compute_logprobs(trained_policy, batch, cfg)
    torch.testing.assert_close(rollouts["logprobs"][mask], training[mask], rtol=0, atol=1e-5)


def _chi_square_test(first: torch.Tensor, second: torch.Tensor) -> tuple[bool, str]:
    statistic, dof = _chi_square_homogeneity(first, second)
    threshold = _chi_square_quantile(dof, z=3.09) if dof > 0 else math.inf
    return statistic < threshold, f"chi2={statistic:.1f} dof={dof} threshold={threshold:.1f}"


@requires_speculation
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_forecast_of_acceptance_matches_the_rollouts_rejection_sampling(trained_policy, temperature):
    """The training step's ``mtp/mtp_1_expected_acceptance`` on a batch of rollouts against the
    acceptance rejection sampling measured producing them: equal within four standard errors of
    the measured rate."""
    generator = torch.Generator().manual_seed(3)
    prompts = [TOKENIZER.encode_prompt(torch.randint(0, 10, (2 + i % 2,), generator=generator).tolist()) for i in range(512)]
    cfg = tiny_config(**engine_overrides(1, **{**SIZES, "train_global_batch_size": 128}, generation__temperature=temperature)).policy
    rollouts = _generate(RolloutEngine(trained_policy, cfg), prompts, seed=1)
    drafts, accepted = int(rollouts["draft_proposed"][0]), int(rollouts["draft_accepted"][0])
    measured = 100.0 * accepted / drafts
    mask, batch = _training_batch(rollouts)
    batch["advantages"] = mask.float()
    batch["prev_logprobs"] = compute_logprobs(trained_policy, batch, cfg)
    metrics = forward_backward_global_batch(trained_policy, batch, IMITATION_LOSS, cfg)
    forecast = metrics["mtp/mtp_1_expected_acceptance"]
    standard_error = 100.0 * math.sqrt(measured / 100 * (1 - measured / 100) / drafts)
    print(f"T={temperature}: measured {measured:.1f}% of {drafts} drafts, forecast {forecast:.1f}%, 4 SE = {4 * standard_error:.1f}")
    assert abs(forecast - measured) < 4 * standard_error


def test_engines_stepped_in_turn_give_each_the_rollouts_it_gives_alone():
    """Three engines over one policy (k = 0, the deepest k the release drafts, auto), stepped one
    engine step each in turn inside one sampling session, as the rollout benchmark steps the
    engines it compares: each returns what a fixed engine at its k returns alone with the same
    seed (tokens, log-probs, drafts proposed and accepted; for auto, at the k it chose), so nothing
    of one engine's step reaches another's. Sampled at temperature 1, so a draw taken from the
    wrong generator would show."""
    policy, _, _ = _policy(0)
    deepest = drafts_where_possible(2)
    engines = [RolloutEngine(policy, tiny_config(**engine_overrides(k)).policy) for k in (0, deepest, "auto")]
    with engines[0].sampling_session():
        rollouts = [engine.begin(PROMPTS, TOKENIZER.eos_id, TOKENIZER.pad_id, seed=11) for engine in engines]
        stepping = list(rollouts)
        while stepping:
            stepping = [rollout for rollout in stepping if rollout.step()]
    in_turn = [rollout.finish() for rollout in rollouts]
    ks = [0, deepest, int(in_turn[2].get("speculative_tokens", 0))]
    alone = [RolloutEngine(policy, tiny_config(**engine_overrides(k)).policy).generate(PROMPTS, TOKENIZER.eos_id, TOKENIZER.pad_id, seed=11) for k in ks]
    assert min(int(rollout["decode_steps"]) for rollout in alone) > 3
    for single, stepped in zip(alone, in_turn):
        for key in ("tokens", "lengths", "logprobs", "decode_steps", "draft_proposed", "draft_accepted"):
            assert torch.equal(stepped[key], single[key]), key
    if deepest:
        assert int(alone[1]["draft_proposed"][0]) > 0
        assert not torch.equal(alone[0]["logprobs"], alone[1]["logprobs"])  # the engines' rollouts do differ
