"""The once-per-step speculative bookkeeping against megatron-core's own per-request bookkeeping:
same rollouts, same log-probs, same acceptance counts; the rewind patch's probe on the installed
release and where upstream changes; the probe of the engine's private names the speculation path
relies on."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.support.engine_cases import skip_module_without_speculation

skip_module_without_speculation()

from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine  # noqa: E402
from megatron.core.inference.text_generation_controllers import text_generation_controller  # noqa: E402

from nemo_rl_mtp.rollout import bookkeeping as engine_bookkeeping  # noqa: E402
from nemo_rl_mtp.megatron_compat import controller_hooks, engine_access, engine_probes, kv_rewind  # noqa: E402
from nemo_rl_mtp.megatron_compat import engine_release  # noqa: E402
from nemo_rl_mtp.rollout.engine import RolloutEngine  # noqa: E402
from nemo_rl_mtp.megatron_compat import speculative_kernels  # noqa: E402
from tests.support.helpers import make_policy  # noqa: E402
from tests.support.engine_cases import PROMPTS, engine_overrides, generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_world")

# megatron's PyTorch speculative kernels beside its triton ones (0.18 on); 0.17 rewinds inside its
# controller, so there is no kernel to vectorise nor a loop to compare with.
try:
    from megatron.core.inference.text_generation_controllers import mtp_utils_pytorch
except ImportError:
    mtp_utils_pytorch = None
REWIND_LOOP_MISSING = mtp_utils_pytorch is None or not hasattr(text_generation_controller, "rewind_kv_cache")
requires_rewind_loop = pytest.mark.skipif(
    REWIND_LOOP_MISSING,
    reason=f"{engine_release.megatron_release()}: its controller rewinds the KV cache in its own method (no rewind_kv_cache kernel to vectorise)",
)


def test_merged_tokens_are_the_accepted_drafts_then_the_new_token():
    accepted = torch.tensor([[5, 6, -1], [-1, -1, -1], [7, 8, 9], [3, -1, -1], [1, 1, 1]])
    sample = torch.tensor([10, 11, 12, 13])  # the buffer holds more rows than the step's requests
    expected = [[token for token in row if token != -1] + [new] for row, new in zip(accepted.tolist(), sample.tolist())]
    assert engine_bookkeeping.merged_tokens(accepted, sample) == expected


@pytest.mark.parametrize("k, verification", [(1, "rejection_sampling"), (2, "rejection_sampling"), (2, "exact_match")])
def test_rollouts_and_counts_equal_megatrons_own_bookkeeping(monkeypatch, k, verification):
    """The reference engine is megatron's DynamicInferenceEngine with its own per-request walk,
    counters, rewind loop and next-pass loop; three requests at a time, temperature 0.7 (drafts
    rejected and accepted, responses cut by the budget mid-step). Where a request ends at an
    accepted end-of-sequence draft j (``controller_hooks.end_at_accepted_end_of_sequence``, in both
    engines), megatron's counters take the end as the step's sampled token, proposed at every
    position: ours count draft j accepted and no draft after it."""
    overrides = engine_overrides(
        k, 2, generation__engine__max_requests=3, generation__temperature=0.7, generation__spec_verification=verification
    )
    policy, cfg = make_policy(**overrides)
    ours = generate(RolloutEngine(policy, cfg), PROMPTS * 2, seed=11)

    # megatron's engine, telling the controller the sampling parameters (RequestSamplingNotes: no bookkeeping)
    monkeypatch.setattr(engine_bookkeeping, "SpeculativeBookkeepingEngine", engine_bookkeeping.RequestSamplingNotes)
    monkeypatch.setattr(kv_rewind, "install_vectorised_rewind", lambda: False)
    if not REWIND_LOOP_MISSING:
        monkeypatch.setattr(text_generation_controller, "rewind_kv_cache", mtp_utils_pytorch.rewind_kv_cache)
        monkeypatch.setattr(text_generation_controller, "prepare_next_forward_pass", mtp_utils_pytorch.prepare_next_forward_pass)
    ended_at = []
    edit = controller_hooks.end_at_accepted_end_of_sequence
    monkeypatch.setattr(controller_hooks, "end_at_accepted_end_of_sequence", lambda *args: ended_at.append(edit(*args)) or ended_at[-1])
    reference_engine = RolloutEngine(policy, cfg)
    assert type(reference_engine.engine) is engine_bookkeeping.RequestSamplingNotes
    reference = generate(reference_engine, PROMPTS * 2, seed=11)
    megatron = reference_engine.engine

    assert torch.equal(ours["tokens"], reference["tokens"]) and torch.equal(ours["logprobs"], reference["logprobs"])
    ends = torch.cat(ended_at).cpu() if ended_at else torch.zeros(0, dtype=torch.long)  # no edit before 0.18
    ends = ends[ends > 0]
    positions = torch.arange(k)
    not_proposed = (positions[None, :] >= ends[:, None]).sum(dim=0)  # by ours, after an accepted end
    end_accepted = (positions[None, :] == ends[:, None] - 1).sum(dim=0)  # by ours, not megatron
    if hasattr(megatron, "_spec_tokens_proposed_per_pos"):
        megatron_counts = (megatron._spec_tokens_proposed_per_pos, megatron._spec_tokens_accepted_per_pos)
        assert torch.equal(ours["draft_proposed"] + not_proposed, megatron_counts[0])
        assert torch.equal(ours["draft_accepted"] - end_accepted, megatron_counts[1])
    else:  # megatron-core 0.17, 0.18 count totals, and k proposed drafts in each request's prefill step too
        assert int((ours["draft_proposed"] + not_proposed).sum()) + k * len(PROMPTS * 2) == megatron._spec_tokens_proposed
        assert int((ours["draft_accepted"] - end_accepted).sum()) == megatron._spec_tokens_accepted
    assert 0 < int(ours["draft_accepted"][0]) < int(ours["draft_proposed"][0])
    assert torch.equal(reference["draft_proposed"], ours["draft_proposed"])  # the controller's count, both engines


@pytest.mark.parametrize("k, verification", [(1, "exact_match"), (2, "rejection_sampling")])
def test_each_steps_log_probs_equal_megatrons_own(monkeypatch, k, verification):
    """At every step of a real rollout (three requests at a time over six prompts: steps with
    prefill requests and decode-only ones, drafts accepted and rejected), the log-prob lists and
    tensor megatron's own ``_dynamic_step_calculate_log_probs_speculative`` computes from the same
    controller state; the decode-only steps are the vectorised ones."""
    megatrons = text_generation_controller.TextGenerationController._dynamic_step_calculate_log_probs_speculative
    ours = controller_hooks.SpeculativeControllerHooks._dynamic_step_calculate_log_probs_speculative
    steps = {"decode only": 0, "with prefill": 0}

    def compared(self, *args, **kwargs):
        lists, tensor = ours(self, *args, **kwargs)
        expected_lists, expected_tensor = megatrons(self, *args, **kwargs)
        assert lists == expected_lists
        assert torch.equal(tensor, expected_tensor)
        steps["decode only" if self.inference_wrapped_model.inference_context.is_decode_only() else "with prefill"] += 1
        return lists, tensor

    monkeypatch.setattr(controller_hooks.SpeculativeControllerHooks, "_dynamic_step_calculate_log_probs_speculative", compared)
    overrides = engine_overrides(
        k, 2, generation__engine__max_requests=3, generation__temperature=0.7, generation__spec_verification=verification
    )
    policy, cfg = make_policy(**overrides)
    rollouts = generate(RolloutEngine(policy, cfg), PROMPTS * 2, seed=11)
    assert steps["decode only"] >= 4 and steps["with prefill"] >= 2, steps
    assert 0 < int(rollouts["draft_accepted"][0]) < int(rollouts["draft_proposed"][0])


@requires_rewind_loop
def test_the_rewind_patch_is_needed_on_the_installed_release_and_idempotent(caplog):
    assert kv_rewind.vectorised_rewind_probe()[0]
    with caplog.at_level(logging.INFO, logger=kv_rewind.__name__):
        assert kv_rewind.install_vectorised_rewind()
        assert kv_rewind.install_vectorised_rewind()
    assert text_generation_controller.rewind_kv_cache is speculative_kernels.rewind_kv_cache


@requires_rewind_loop
@pytest.mark.parametrize("upstream", ["gone", "replaced", "different results"])
def test_the_rewind_patch_switches_itself_off_where_upstream_changed(monkeypatch, caplog, upstream):
    if upstream == "gone":
        monkeypatch.delattr(text_generation_controller, "rewind_kv_cache")
    elif upstream == "replaced":
        monkeypatch.setattr(text_generation_controller, "rewind_kv_cache", lambda *args, **kwargs: None)
    else:
        original = mtp_utils_pytorch.rewind_kv_cache

        def rewinds_one_more(accepted_counts, *args, **kwargs):
            return original(accepted_counts - 1, *args, **kwargs)

        rewinds_one_more.__signature__ = __import__("inspect").signature(original)
        monkeypatch.setattr(mtp_utils_pytorch, "rewind_kv_cache", rewinds_one_more)
        monkeypatch.setattr(text_generation_controller, "rewind_kv_cache", rewinds_one_more)
    before = getattr(text_generation_controller, "rewind_kv_cache", None)
    with caplog.at_level(logging.WARNING, logger=kv_rewind.__name__):
        assert not kv_rewind.install_vectorised_rewind()
    assert "not installed" in caplog.text
    assert getattr(text_generation_controller, "rewind_kv_cache", None) is before


def test_every_private_engine_name_the_speculation_path_needs_is_in_the_installed_release():
    policy, cfg = make_policy(**engine_overrides(2, 2))
    assert engine_probes.changed_names(RolloutEngine(policy, cfg).engine, cfg.generation) == []


def _mtp_layer_class():
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    return MultiTokenPredictionLayer


@pytest.mark.parametrize(
    "owner, name",
    [
        (text_generation_controller.TextGenerationController, "_compute_serial_mtp_and_sample"),
        (text_generation_controller.TextGenerationController, "_sample_from_logits_2d"),
        (text_generation_controller.TextGenerationController, "_verify_speculative_tokens"),
        (text_generation_controller.TextGenerationController, "_dynamic_step_sample_logits_and_verify_tokens"),
        (text_generation_controller.TextGenerationController, "_dynamic_step_calculate_log_probs_speculative"),
        (text_generation_controller.TextGenerationController, "_sampled_tokens_cuda"),
        (text_generation_controller.TextGenerationController, "_last_accepted_seq_indices"),
        (text_generation_controller.TextGenerationController, "_accepted_tokens_per_request"),
        (DynamicInferenceEngine, "_spec_steps"),
        ("the verification rows' hook", "sample_speculative|_sample_speculative_logits"),
        (_mtp_layer_class, "forward_single_position"),
    ],
)
def test_a_renamed_private_name_stops_the_engine_build_naming_it(monkeypatch, owner, name):
    """An override megatron no longer calls would leave its own drafting or verification in place,
    silently. The real class, its member removed (an instance attribute: removed after the
    constructor or reset sets it)."""
    policy, cfg = make_policy(**engine_overrides(1, 1))
    if owner == "the verification rows' hook":  # the sampling backend's (0.18 on), else the controller's (0.17)
        backend = engine_access.sampling_backend(RolloutEngine(policy, cfg).engine.controller)
        owner, name = (type(backend), "sample_speculative") if backend is not None else (text_generation_controller.TextGenerationController, "_sample_speculative_logits")
    owner = owner if isinstance(owner, type) else owner()
    if hasattr(owner, name):
        monkeypatch.delattr(next(cls for cls in owner.__mro__ if name in vars(cls)), name)
    else:
        setter = "reset" if owner is DynamicInferenceEngine else "__init__"
        original = getattr(owner, setter)

        def without_attribute(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.__dict__.pop(name, None)

        monkeypatch.setattr(owner, setter, without_attribute)
    with pytest.raises(RuntimeError, match=name):
        RolloutEngine(policy, cfg)


def test_without_the_backends_log_probs_kernel_rejection_sampling_writes_the_distribution_out(monkeypatch, caplog):
    """The fallback where the sampling backend has no ``log_probs_kernel`` (0.17, 0.18), on the
    installed release with the kernel removed from the real class: logged, and the same rollouts
    from the same seed as with the kernel (the same distribution, drawn from the same generator)."""
    overrides = engine_overrides(2, 2, generation__temperature=0.7, generation__top_p=0.9)
    policy, cfg = make_policy(**overrides)
    native = generate(RolloutEngine(policy, cfg), PROMPTS, seed=5)
    backend = engine_access.sampling_backend(RolloutEngine(policy, cfg).engine.controller)
    for cls in type(backend).__mro__:
        if "log_probs_kernel" in vars(cls):
            monkeypatch.delattr(cls, "log_probs_kernel")
    with caplog.at_level(logging.INFO):
        engine = RolloutEngine(policy, cfg)
    assert engine.engine.controller._native_log_probs is None
    assert "the sampling distribution written out" in caplog.text
    written_out = generate(engine, PROMPTS, seed=5)
    assert torch.equal(written_out["tokens"], native["tokens"]) and torch.equal(written_out["draft_accepted"], native["draft_accepted"])


@requires_rewind_loop
def test_the_rewind_behaviour_check_runs_once_per_upstream_function(monkeypatch):
    """Engine builds reuse the verdict for the function they compare with; another function (a
    control: upstream replaced it) is checked again."""
    calls = []
    original = kv_rewind._same_rewind
    monkeypatch.setattr(kv_rewind, "_same_rewind", lambda reference: calls.append(reference) or original(reference))
    monkeypatch.setattr(kv_rewind, "_SAME_RESULTS", {})
    monkeypatch.setattr(text_generation_controller, "rewind_kv_cache", mtp_utils_pytorch.rewind_kv_cache)
    for _ in range(3):
        assert kv_rewind.vectorised_rewind_probe()[0]
    assert calls == [mtp_utils_pytorch.rewind_kv_cache]

    def another_loop(*args, **kwargs):
        return original_loop(*args, **kwargs)

    original_loop = mtp_utils_pytorch.rewind_kv_cache
    another_loop.__signature__ = __import__("inspect").signature(original_loop)
    monkeypatch.setattr(mtp_utils_pytorch, "rewind_kv_cache", another_loop)
    monkeypatch.setattr(text_generation_controller, "rewind_kv_cache", another_loop)
    assert kv_rewind.vectorised_rewind_probe()[0]
    assert calls == [original_loop, another_loop]


def test_the_sampler_probe_runs_once_per_sampling_function(monkeypatch):
    """Without the backend's log_probs_kernel each rejection-sampling build asks whether the
    release's sampler draws from the written-out distribution: asked once, then reused."""
    policy, cfg = make_policy(**engine_overrides(1, 1))
    backend = engine_access.sampling_backend(RolloutEngine(policy, cfg).engine.controller)
    for cls in type(backend).__mro__:
        if "log_probs_kernel" in vars(cls):
            monkeypatch.delattr(cls, "log_probs_kernel")
    calls = []
    original = engine_probes._sampler_agrees
    monkeypatch.setattr(engine_probes, "_sampler_agrees", lambda controller: calls.append(1) or original(controller))
    monkeypatch.setattr(engine_probes, "_SAMPLER_VERDICTS", {})
    for _ in range(2):
        assert RolloutEngine(policy, cfg).engine.controller._native_log_probs is None
    assert len(calls) == 1
