"""Host reads of device values per decode step, by our code (as ``test_host_syncs`` counts them for
training). On a GPU each is a host-device synchronisation. Per decode step, from the code path:

- drafts and verification (incremental drafts, the draft round, rejection sampling, the
  acceptance counts, the vectorised kernels): no device value; their consistency checks are
  device asserts. The incremental drafts read the longest request's block count once, from the
  engine's bookkeeping, which megatron keeps on the host (no synchronisation on a GPU);
- the engine's bookkeeping: the step's tokens to the host, once (``merged_tokens``: the tokens and
  their counts, two reads; megatron reads its sample and accepted drafts there too);
- the step's log-prob lists (``speculative_kernels.decode_log_probs``): the log-probs and the
  accepted counts, two reads, where megatron's own method read each request's count and row
  apart (two per request);
- the CPU paged attention (a stand-in for flash-attn that exists only without a device): the
  longest key length, once per decoder layer.

A prefill step reads also the longest prompt: in the paged attention's varlen path (per layer)
and once in the incremental drafts' layout (host-side bookkeeping again).
"""

from __future__ import annotations

from collections import Counter

import pytest

from nemo_rl_mtp.rollout.engine import RolloutEngine
from tests.support.helpers import make_policy
from tests.support.engine_cases import PROMPTS, TOKENIZER, engine_overrides, requires_speculation
from tests.unit.training.test_host_syncs import PACKAGE_DIR, HostReadCounter

pytestmark = pytest.mark.usefixtures("megatron_world")

def _per_step_reads(engine: RolloutEngine) -> list[Counter]:
    """Our code's host reads in each engine step of one rollout (all prompts admitted at once:
    step 1 prefills, every later step decodes), by file."""
    engine.engine.reset()
    engine.engine.controller.sampling_rng.manual_seed(0)
    drafter = getattr(engine.engine.controller, "drafter", None)
    if drafter is not None:
        drafter.reset(len(PROMPTS))
    params = engine.sampling_params(TOKENIZER.eos_id)
    for request_id, prompt in enumerate(PROMPTS):
        engine.engine.add_request(request_id, prompt, params)
    steps = []
    from nemo_rl_mtp.rollout.engine import rollout_mode

    with rollout_mode(engine.policy.model):
        while engine.engine.has_unfinished_requests():
            with HostReadCounter() as counter:
                engine.engine.step_modern()
            by_file = Counter()
            for location, count in counter.ours().items():
                by_file[location.removeprefix(PACKAGE_DIR + "/").split(":")[0]] += count
            steps.append(by_file)
    return steps


def _decode_steps_take_the_varlen_attention(engine: RolloutEngine, monkeypatch) -> bool:
    """Probe: whether megatron's attention runs decode steps through the variable-length prefill
    kernel, as 0.16 does and 0.17 does with drafts (k + 1 queries per request); 0.19 runs the paged
    decode kernel. The bounds below are derived for the decode kernel."""
    from megatron.core.transformer import attention

    calls = []
    varlen = attention.flash_attn_varlen_func
    monkeypatch.setattr(attention, "flash_attn_varlen_func", lambda *args, **kwargs: calls.append(1) or varlen(*args, **kwargs))
    steps = len(_per_step_reads(engine))
    monkeypatch.setattr(attention, "flash_attn_varlen_func", varlen)
    prefill_calls = engine.policy.model.module.config.num_layers
    return steps > 1 and len(calls) > prefill_calls


@pytest.mark.parametrize("k", [0, pytest.param(1, marks=requires_speculation), pytest.param(2, marks=requires_speculation)])
def test_a_decode_step_reads_the_host_a_fixed_number_of_times(k, monkeypatch):
    num_layers = 2
    policy, cfg = make_policy(**engine_overrides(k, 2, megatron_cfg__num_layers=num_layers))
    engine = RolloutEngine(policy, cfg)
    if _decode_steps_take_the_varlen_attention(engine, monkeypatch):
        from nemo_rl_mtp.megatron_compat.engine_release import megatron_release

        pytest.skip(f"{megatron_release()}: its decode steps (k = {k}) run megatron's varlen prefill attention, not the decode kernel these bounds are derived for")
    speculative_walks = []  # per step: whether the engine's walk got the step's accepted drafts
    walk = engine.engine.post_process_requests
    monkeypatch.setattr(
        engine.engine, "post_process_requests", lambda *args, **kwargs: speculative_walks.append(args[5] is not None) or walk(*args, **kwargs)
    )
    steps = _per_step_reads(engine)
    decode_steps = steps[1:]
    assert len(decode_steps) >= 3
    expected = Counter({"megatron_compat/cpu/paged_attention.py": num_layers})
    if k:
        expected["rollout/bookkeeping.py"] = 2
        expected["rollout/incremental_drafts.py"] = 1
        expected["megatron_compat/speculative_kernels.py"] = 2
    for step, reads in enumerate(decode_steps, start=2):
        assert reads == expected, (step, reads)
    prefill = Counter({"megatron_compat/cpu/paged_attention.py": 2 * num_layers})
    if k:
        prefill["rollout/incremental_drafts.py"] = 2
    if k and speculative_walks[0]:  # 0.18 hands the prefill step's (empty) accepted drafts to the walk too: merged
        prefill["rollout/bookkeeping.py"] = 2
    assert steps[0] == prefill, steps[0]
