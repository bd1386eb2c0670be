"""Rollouts on megatron-core's dynamic inference engine, over the policy's live training model.

The engine is built once per policy worker, around the GPTModel being trained (no weight copy:
every rollout samples from the newest weights), and reset before each rollout. It keeps a paged KV
cache and, with ``num_speculative_tokens > 0``, speculates with the model's own MTP heads
(see :mod:`speculation`).

What the engine needs from us around each rollout:
- eval mode, no autograd and megatron's ``InferenceMode`` flag set (0.18 on; on 0.16 and 0.17 the
  model tells an engine's forward by eval mode alone), and afterwards the flag and the model's
  train/eval mode as they were: cleared and training outside a rollout (a training forward with
  the flag set skips the MTP loss);
- the policy's sampling distribution on the output layer: logits / temperature with the padding
  ids masked (:func:`policy_sampling_distribution`). The engine then samples at temperature 1
  and its raw log-probs are the log-probs under the sampling temperature, as training computes
  them (megatron refuses its ``processed_logprobs`` with speculation). MTP drafts come through the
  same output layer, so they are drafted from the same tempered distribution;
- a seed: the engine draws from one generator per controller, reseeded for each rollout.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from nemo_rl_mtp.megatron_compat import engine_access, engine_probes, engine_release, engine_teardown, kv_rewind
from nemo_rl_mtp.rollout import auto_k, bookkeeping, controllers, incremental_drafts, machine_speed
from nemo_rl_mtp.rollout.speculation import speculation_counts, through_first_end
from nemo_rl_mtp.megatron_compat.cpu import inference_runtime as cpu_inference_runtime
from nemo_rl_mtp.megatron_compat.cpu import training_runtime as cpu_runtime
from nemo_rl_mtp.training import hybrid
from nemo_rl_mtp.training.module_modes import eval_mode
from nemo_rl_mtp.training.model import MegatronPolicyModel
from nemo_rl_mtp.training.vocabulary import fill_ids_past_vocabulary_
from nemo_rl_mtp.config.schema import GenerationConfig, PolicyConfig
from nemo_rl_mtp.metrics import DECODE_STEPS, LENGTHS, LOGPROBS, PROMPT_LENGTHS, TOKENS

logger = logging.getLogger(__name__)


class RolloutEngine:
    """megatron-core's DynamicInferenceEngine over one policy worker's live model. With
    ``num_speculative_tokens: auto`` the drafts per step are chosen before each rollout
    (:mod:`adaptive_speculation`) and the engine rebuilt when they change (one engine at a time:
    its memory stays within the budget)."""

    def __init__(self, policy: MegatronPolicyModel, policy_cfg: PolicyConfig):
        self.policy = policy
        self.policy_cfg = policy_cfg
        self.generation_cfg = policy_cfg.generation
        requested = self.generation_cfg.num_speculative_tokens
        self.adaptive = None
        if requested == auto_k.AUTO and not engine_release.auto_without_speculation(self.generation_cfg):
            self.adaptive = auto_k.AdaptiveSpeculation(auto_k.auto_limit(policy_cfg.megatron_cfg))
        self.num_speculative_tokens = 0 if requested == auto_k.AUTO else requested
        self.engine = build_engine(policy.model.module, policy_cfg, self.num_speculative_tokens)
        # On a CPU, auto's reading of the machine's speed (machine_speed), across its rollouts.
        self.speed_probe = machine_speed.SpeedProbe(auto_k.step_clock()) if self.adaptive is not None and machine_speed.applies() else None

    def use_speculative_tokens(self, k: int) -> None:
        """Rebuild the engine for ``k`` drafts per step if it has another number."""
        if k != self.num_speculative_tokens:
            replaced, self.engine = self.engine, None
            engine_teardown.release(replaced)  # the old engine's memory goes before the new one's comes
            del replaced
            self.engine = build_engine(self.policy.model.module, self.policy_cfg, k)
            self.num_speculative_tokens = k

    def generate(self, prompts: list[list[int]], eos_id: int, pad_id: int, seed: int, greedy: bool = False) -> dict[str, torch.Tensor]:
        """Sample a response to each prompt (token ids); with ``greedy``, the most likely one.

        Returns host tensors: ``tokens`` [B, S] (prompt + response, right-padded with ``pad_id``),
        ``lengths`` [B], ``prompt_lengths`` [B], ``logprobs`` [B, S] (token-aligned: each response
        token's log-prob under the sampling temperature, 0 elsewhere), ``decode_steps`` [] (engine
        forward passes) and the speculation counts ``draft_proposed``/``draft_accepted`` [k]; with
        ``auto``, also ``speculative_tokens`` [] (the k chosen), ``expected_tokens_per_s`` and
        ``engine_tokens_per_s`` [] (what the choice expected, what the engine delivered; per second
        of the clock auto measures with, ``auto_k.step_clock``).
        """
        with self.sampling_session():
            rollout = self.begin(prompts, eos_id, pad_id, seed, greedy)
            while rollout.step():
                pass
        return rollout.finish()

    def begin(self, prompts: list[list[int]], eos_id: int, pad_id: int, seed: int, greedy: bool = False) -> "Rollout":
        """:meth:`generate` one engine step at a time, for a caller inside :meth:`sampling_session`
        that steps several engines over one policy in turn (``benchmarks/rollout_throughput.py``
        compares engines that way). ``auto`` chooses its k here."""
        return Rollout(self, prompts, eos_id, pad_id, seed, greedy)

    def start(self, prompts: list[list[int]], seed: int, params) -> None:
        """A fresh rollout of ``prompts`` (request ids their indices) with megatron's ``params``,
        sampling from a generator seeded with ``seed``: the engine reset, the requests added."""
        self.engine.reset()
        self.engine.controller.sampling_rng.manual_seed(seed)
        drafter = getattr(self.engine.controller, "drafter", None)
        if hasattr(drafter, "reset"):
            drafter.reset(len(prompts))
        for request_id, prompt in enumerate(prompts):
            self.engine.add_request(request_id, prompt, params)

    @contextlib.contextmanager
    def sampling_session(self):
        """Rollout mode and the policy's sampling distribution on the output layer."""
        with rollout_mode(self.policy.model), policy_sampling_distribution(
            self.policy.model.module, self.generation_cfg.temperature, self.policy.vocab_size
        ):
            yield

    def observe_training_metrics(self, metrics: dict[str, float]) -> None:
        """After a training step: its acceptance forecast for ``auto``."""
        if self.adaptive is not None:
            self.adaptive.observe_forecast(auto_k.forecast_from_metrics(metrics))

    def sampling_params(self, eos_id: int, greedy: bool = False):
        """megatron's SamplingParams for our generation config. Temperature is applied to the
        logits (see module docstring), so megatron samples at 1.0; our top_p "off" (1.0) is 0.0
        there."""
        from megatron.core.inference.sampling_params import SamplingParams

        cfg = self.generation_cfg
        return SamplingParams(
            temperature=1.0,
            top_k=1 if greedy else cfg.top_k,
            top_p=0.0 if greedy or cfg.top_p >= 1.0 else cfg.top_p,
            return_log_probs=True,
            skip_prompt_log_probs=True,
            num_tokens_to_generate=cfg.max_new_tokens,
            termination_id=eos_id,
        )


def build_engine(model, policy_cfg: PolicyConfig, num_speculative_tokens: int):
    """Context (paged KV cache), wrapper, controller and engine around ``model`` with
    ``num_speculative_tokens`` drafts per step, as megatron's own ``MegatronLLM`` assembles them
    (the installed release's way: :mod:`engine_release`). Building sets megatron's process-wide
    ``InferenceMode`` flag and may switch the model to eval mode; both are put back as they were
    (:func:`modes_restored`), so training forwards stay training forwards."""
    unsupported = engine_release.unsupported_speculation(num_speculative_tokens, policy_cfg.megatron_cfg) if num_speculative_tokens else None
    if unsupported is not None:
        raise ValueError(unsupported)
    engine_probes.check_class_names(model, policy_cfg.generation, num_speculative_tokens)
    with modes_restored(model):
        cpu_inference_runtime.install()
        if num_speculative_tokens:
            kv_rewind.install_vectorised_rewind()
        sizing = policy_cfg.generation.engine
        controller = controller_class(model, policy_cfg.generation, num_speculative_tokens)
        mtp_share = mtp_cache_share(model, controller, num_speculative_tokens)
        engine_class = bookkeeping.SpeculativeBookkeepingEngine if num_speculative_tokens else megatron_engine_class()
        with cpu_runtime.device_scope():
            engine = engine_release.assemble(
                model, controller, engine_class, sizing, policy_cfg.max_total_sequence_length, num_speculative_tokens,
                sizing.buffer_size_gb * (1.0 - mtp_share), hybrid.mamba_inference_state(model),
            )
    engine_probes.check_engine_names(engine, policy_cfg.generation)
    log_kv_memory(engine)
    return engine


def megatron_engine_class() -> type:
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine

    return DynamicInferenceEngine


@contextlib.contextmanager
def modes_restored(model):
    """Eval mode for the duration; afterwards, whatever happens inside, megatron's ``InferenceMode``
    flag (where the release has one) and every submodule's train/eval mode are what they were
    before (``module_modes.eval_mode``), not what a rollout or an engine build left, nor a mode
    forced on the whole model."""
    flag = engine_access.inference_mode_flag()
    was_active = flag.is_active() if flag is not None else None
    try:
        with eval_mode(model):
            yield
    finally:
        if flag is not None:
            flag.set_active() if was_active else flag.unset_active()


def mtp_cache_share(model, controller: type, num_speculative_tokens: int) -> float:
    """The share of the engine's memory budget that incremental drafts keep for the MTP caches."""
    if not issubclass(controller, incremental_drafts.IncrementalDraftsController):
        return 0.0
    return incremental_drafts.mtp_cache_share(kv_cache_layers(model), engine_access.draft_depths(model, num_speculative_tokens))


def kv_cache_layers(model) -> int:
    """How many of this stage's decoder layers megatron's context keeps keys and values for: with
    Mamba layers (a hybrid context), the attention layers only; otherwise every layer, as the
    context treats any model without Mamba layers (an attention and MLP hybrid included) as a
    transformer and sizes a block for each of its layers."""
    layers = model.decoder.layers
    if not hybrid.mamba_inference_state(model):
        return len(layers)
    from megatron.core.transformer.attention import SelfAttention

    return sum(isinstance(getattr(layer, "self_attention", None), SelfAttention) for layer in layers)


def kv_memory(engine) -> dict[str, int]:
    """Bytes of the engine's KV cache (``trunk``) and of the MTP depths' caches (``mtp``)."""
    context = engine.context
    drafter = getattr(engine.controller, "drafter", None)
    mtp = drafter.cache.nbytes if isinstance(drafter, incremental_drafts.IncrementalDrafts) else 0
    return {"trunk": context.block_size_bytes * context.kv_block_allocator.total_count, "mtp": mtp}


def log_kv_memory(engine) -> None:
    if not isinstance(getattr(engine.controller, "drafter", None), incremental_drafts.IncrementalDrafts):
        return
    memory = kv_memory(engine)
    if memory["mtp"]:
        logger.info(
            "KV cache: %.1f MiB for the decoder, %.1f MiB for the MTP depths' caches (%d blocks of %d tokens)",
            memory["trunk"] / 2**20, memory["mtp"] / 2**20, engine.context.kv_block_allocator.total_count,
            engine.context.block_size_tokens,
        )


def controller_class(model, generation_cfg: GenerationConfig, num_speculative_tokens: int) -> type:
    """megatron's TextGenerationController without speculation; with it, the controller of
    :data:`controllers.CONTROLLERS` that verifies drafts as ``spec_verification`` says and drafts
    as ``draft_context`` says where the installed engine's draft step cannot see a request's
    earlier positions: from the MTP depths' KV caches (:mod:`incremental_drafts`) or from each
    request's sequence (:mod:`sequence_drafts`)."""
    if num_speculative_tokens == 0:
        from megatron.core.inference.text_generation_controllers.text_generation_controller import (
            TextGenerationController,
        )

        return TextGenerationController
    return controllers.CONTROLLERS[(draft_source(model, generation_cfg), generation_cfg.spec_verification)]


def draft_source(model, generation_cfg: GenerationConfig) -> str:
    """Which drafts serve the engine's draft rounds (a key of :data:`controllers.CONTROLLERS`)."""
    if generation_cfg.draft_context == "single_position":
        return controllers.MEGATRON_DRAFTS
    if engine_probes.upstream_drafts_have_context(model):
        logger.info("MTP drafts: the installed engine's draft step reads a request's context; using it as is")
        return controllers.MEGATRON_DRAFTS
    source = controllers.SEQUENCE_DRAFTS
    if generation_cfg.draft_context == "incremental":
        reason = incremental_drafts.unsupported_reason(model)
        if reason is None:
            source = controllers.INCREMENTAL_DRAFTS
        else:
            logger.warning("MTP drafts: no incremental drafts for %s; drafting from each request's sequence", reason)
    if getattr(model, "mtp", None) is not None:  # a pipeline stage before the MTP layers: nothing to measure
        log_serial_step_leak(model, generation_cfg.draft_context)
    return source


def log_serial_step_leak(model, draft_context: str) -> None:
    """Why the drafts come from our drafters, with megatron's serial step's leak measured (once per
    process: :func:`engine_probes.serial_step_leak`)."""
    with rollout_mode(model):
        leak = engine_probes.serial_step_leak(model)
    if leak is None:
        return
    logger.info(
        "MTP drafts: megatron-core's serial draft step sees one position per request (a draft's logits moved by %.1e "
        "when another request's input changed); drafting with each request's context instead (%s)",
        leak, draft_context,
    )


@contextlib.contextmanager
def rollout_mode(model):
    """Eval mode, no autograd and megatron's InferenceMode flag (where the release has one) for the
    duration of a rollout; afterwards the flag and each module's mode as they were
    (:func:`modes_restored`), whatever happens. Nests: an engine built during a rollout (``auto``
    switching k) leaves the rollout's mode in place.

    No ``cpu_runtime.device_scope()``: once the engine is built, generation reaches no "cuda"
    literal (the local spec's default mask is built on the query's device), and the scope's torch
    function mode costs a Python call per torch op: it took half of a rollout's time on the CPU."""
    flag = engine_access.inference_mode_flag()
    with modes_restored(model), torch.no_grad():
        if flag is not None:
            flag.set_active()
        yield


@contextlib.contextmanager
def policy_sampling_distribution(model, temperature: float, vocab_size: int):
    """Make the output layer emit the logits of the policy's sampling distribution: divided by
    the temperature, -inf on ids past the tokenizer's vocabulary. A no-op on pipeline stages
    without an output layer."""
    output_layer = getattr(model, "output_layer", None) if model.post_process else None
    if output_layer is None:
        yield
        return

    def tempered(module, inputs, output):
        logits, bias = output
        return fill_ids_past_vocabulary_(logits / temperature, vocab_size, model.vocab_size), bias  # in the quotient, a new tensor

    handle = output_layer.register_forward_hook(tempered)
    try:
        yield
    finally:
        handle.remove()


class Rollout:
    """One rollout of a :class:`RolloutEngine`, stepped by its caller inside the engine's sampling
    session: made, it has chosen k (``auto``) and added every prompt; :meth:`step` runs one engine
    step; :meth:`finish` returns what :meth:`RolloutEngine.generate` returns.

    Its seconds, what ``auto`` learns from, are the sum of its own steps' (adding the requests
    included), on ``auto_k.step_clock``: several engines stepped in turn each count their own work
    only. Stepped so, engines share every drift of the machine's speed: on a 2-core VM two
    identical engines' whole rollouts run one after the other differed by 5-14% (the standard
    deviation of their ratio over 8 rounds), stepped in turn by 0.4%. ``auto`` on a CPU also
    reads the machine's speed during the rollout (:mod:`machine_speed`), so that it can compare
    its rollouts of different k, which run one after the other."""

    def __init__(self, rollout_engine: RolloutEngine, prompts: list[list[int]], eos_id: int, pad_id: int, seed: int, greedy: bool):
        self.rollout_engine, self.prompts, self.eos_id, self.pad_id, self.greedy = rollout_engine, prompts, eos_id, pad_id, greedy
        check_room_for_responses(prompts, rollout_engine.generation_cfg.max_new_tokens, rollout_engine.engine.context.max_sequence_length)
        params = rollout_engine.sampling_params(eos_id, greedy)
        self.choice = auto_k.choose(rollout_engine, prompts, params, greedy) if rollout_engine.adaptive is not None else None
        self.clock = auto_k.step_clock()
        self.speed_probe = rollout_engine.speed_probe
        self.probes_before = self.speed_probe.taken if self.speed_probe is not None else 0
        self.seconds, self.steps, self.finished = 0.0, 0, []
        start = self.clock()
        rollout_engine.start(prompts, seed, params)
        self.seconds += self.clock() - start

    def step(self) -> bool:
        """One engine step (none if every request has finished); whether requests remain."""
        engine = self.rollout_engine.engine
        if engine.has_unfinished_requests():
            start = self.clock()
            self.finished.extend(engine.step_modern()["finished_request_records"])
            step_seconds = self.clock() - start
            self.seconds += step_seconds
            self.steps += 1
            if self.speed_probe is not None:
                self.speed_probe.after_step(step_seconds)
        return engine.has_unfinished_requests()

    def finish(self) -> dict[str, torch.Tensor]:
        """The finished requests in prompt order as :func:`right_padded_rollouts`, with the engine
        steps (forward passes), the speculation counts and ``auto``'s record (:meth:`RolloutEngine.generate`)."""
        engine = self.rollout_engine.engine
        responses = [record.merge() for record in sorted(self.finished, key=lambda record: record.request_id)]
        _raise_on_failed_requests(responses, engine.context.max_sequence_length)
        rollouts = right_padded_rollouts(self.prompts, responses, self.eos_id, self.pad_id)
        rollouts[DECODE_STEPS] = torch.tensor(self.steps)
        rollouts.update(speculation_counts(engine))
        if self.choice is not None:
            probe_seconds = self.speed_probe.reading(self.probes_before) if self.speed_probe is not None else None
            rollouts.update(auto_k.record(self.rollout_engine.adaptive, self.choice, rollouts, self.greedy, self.seconds, probe_seconds))
        return rollouts


def check_room_for_responses(prompts: list[list[int]], max_new_tokens: int, max_sequence_length: int) -> None:
    """Refuse, before any request reaches the engine (or ``auto``'s profile), a prompt without room
    for ``max_new_tokens`` after it in ``max_sequence_length``. megatron-core (0.19.2 measured)
    would cut such a response short without a word (an 18-token prompt got 6 of 12 new tokens in a
    24-token engine), fail inside its own bookkeeping on a prompt that fills the sequence exactly
    (an IndexError in ``post_process_requests``), and refuse a longer one with a warning: a
    rollout cut short would reach training as if the policy had ended it. The GRPO loop checks its
    tasks' prompts when the config is loaded; this is for every other caller."""
    for index, prompt in enumerate(prompts):
        if len(prompt) + max_new_tokens > max_sequence_length:
            raise ValueError(
                f"rollout prompt {index} has {len(prompt)} tokens: with policy.generation.max_new_tokens={max_new_tokens} it needs "
                f"{len(prompt) + max_new_tokens} > the engine's {max_sequence_length} (policy.max_total_sequence_length)"
            )


def _raise_on_failed_requests(responses: list, max_sequence_length: int) -> None:
    """The engine finishes a request it cannot take (too long, no room) as FAILED, with a warning;
    a rollout with a missing response must not reach training."""
    from megatron.core.inference.inference_request import Status

    failed = [request for request in responses if request.status == Status.FAILED]
    if failed:
        request = failed[0]
        raise RuntimeError(
            f"the inference engine refused {len(failed)} rollout request(s), e.g. one of {len(request.prompt_tokens)} "
            f"prompt tokens + {request.sampling_params.num_tokens_to_generate} new tokens with max_sequence_length "
            f"{max_sequence_length}; see its warning above, and policy.max_total_sequence_length and "
            "policy.generation.engine.* in the config"
        )


def right_padded_rollouts(prompts: list[list[int]], responses: list, eos_id: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Prompt + response rows, right-padded, with token-aligned response log-probs. A response
    ends at its first end-of-sequence token: accepted drafts may run past it within a step."""
    generated = [through_first_end(list(request.generated_tokens), eos_id) for request in responses]
    prompt_lengths = torch.tensor([len(prompt) for prompt in prompts])
    lengths = prompt_lengths + torch.tensor([len(tokens) for tokens in generated])
    tokens = torch.full((len(prompts), int(lengths.max())), pad_id, dtype=torch.long)
    logprobs = torch.zeros(tokens.shape, dtype=torch.float32)
    for row, (prompt, response, request) in enumerate(zip(prompts, generated, responses)):
        tokens[row, : len(prompt)] = torch.tensor(prompt)
        tokens[row, len(prompt) : len(prompt) + len(response)] = torch.tensor(response, dtype=torch.long)
        logprobs[row, len(prompt) : len(prompt) + len(response)] = torch.tensor(
            request.generated_log_probs[: len(response)]
        )
    return {TOKENS: tokens, LENGTHS: lengths, PROMPT_LENGTHS: prompt_lengths, LOGPROBS: logprobs}
