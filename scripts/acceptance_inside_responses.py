"""The project's engine on an export, greedy over the run's held-out prompts: its draft counts as
``val/draft_1_acceptance_rate`` takes them, and the same drafts replayed from the training forward
counting only those whose token lies inside the response (through its first end-of-sequence
token), the drafts vLLM counts. megatron's engine ends a request only when its *sampled* token is
the end of sequence, not an accepted draft, so a request whose accepted draft was the end kept
decoding (and drafting) until a sampled token ended it, and those steps' drafts were in the
engine's counts (docs/serving.md, "Measured"). The engine now ends a request at an accepted end
draft (docs/rollouts.md, "Verification"), so the two figures should agree. One draft per step.

    uv run python -m scripts.acceptance_inside_responses logs/<run>/config.yaml exported/<run>
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from omegaconf import read_write

from examples.serve_check import held_out_prompts
from nemo_rl_mtp.config.load import load_saved_config, resolve_checkpoint_keys
from nemo_rl_mtp.rollout.engine import RolloutEngine
from nemo_rl_mtp.training import hf_checkpoint
from nemo_rl_mtp.training.model import initialize_model_parallel, setup_megatron_policy
from tests.support.helpers import expected_draft_counts, free_port


def main(config: str, export: str) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    logging.basicConfig(level=logging.WARNING)
    cfg = load_saved_config(config)
    with read_write(cfg):
        cfg.policy.model_name = str(Path(export).resolve())
    bridge = hf_checkpoint.open_checkpoint(cfg.policy.model_name, cfg.policy.trust_remote_code)
    cfg = resolve_checkpoint_keys(cfg, hf_checkpoint.checkpoint_facts(bridge, cfg.policy.model_name))
    initialize_model_parallel(cfg.policy.megatron_cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    model_parallel_cuda_manual_seed(cfg.policy.megatron_cfg.seed)
    held_out, _, tokenizer = held_out_prompts(cfg, Path(export))
    policy = setup_megatron_policy(cfg.policy, tokenizer.vocab_size)
    engine = RolloutEngine(policy, cfg.policy)
    rollouts = engine.generate([prompt.prompt_ids for prompt in held_out], tokenizer.eos_id, tokenizer.pad_id, seed=0, greedy=True)
    proposed, accepted = int(rollouts["draft_proposed"][0]), int(rollouts["draft_accepted"][0])
    print(f"engine's counts (val/): {accepted}/{proposed} = {100 * accepted / proposed:.1f}%")
    proposed, accepted = expected_draft_counts(policy, rollouts)
    print(f"drafts inside the responses: {accepted}/{proposed} = {100 * accepted / proposed:.1f}%")


if __name__ == "__main__":
    main(*sys.argv[1:3])
