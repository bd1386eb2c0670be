"""Shared test helpers: a single-process megatron world, tiny policies and synthetic RL batches."""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from nemo_rl_mtp.tasks.demonstrations import demonstration_batch
from nemo_rl_mtp.tasks.digit_tasks import answer_ids, expected_answer, prompt_ids
from nemo_rl_mtp.grpo.checked_config import load_checked_config
from tests.support.synthetic import synthetic_rl_batch

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES = REPO_ROOT / "examples" / "configs"
# examples/run_grpo.py's default recipe (the script names it; the package's command has none).
# The recipe the functional tests build on (the tiny GPT on the reverse task).
BASE_RECIPE = RECIPES / "grpo_mtp_tiny_cpu.yaml"
# What `uv run examples/run_grpo.py` runs without --config.
DEFAULT_RECIPE = RECIPES / "grpo_mtp_default_tiny_cpu.yaml"
VOCAB_SIZE = 32
# GRPO steps smaller than the default recipe's, to keep CI short: 8 prompts x 4 samples.
SMALL_GRPO_STEP = [
    "grpo.num_prompts_per_step=8",
    "grpo.num_generations_per_prompt=4",
    "policy.train_global_batch_size=32",
    "policy.train_micro_batch_size=8",
    "logger.console=false",
    "grpo.warmup_imitation_steps=0",
    "grpo.val_num_prompts=8",
]


def run_grpo(argv: list[str], recipe: Path = BASE_RECIPE) -> int:
    """``examples/run_grpo.py <argv>`` in this process, on the base recipe unless argv has --config
    (``recipe`` otherwise): the exit status."""
    from nemo_rl_mtp.cli import main

    return main(argv, default_config=recipe)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_config(**policy_overrides):
    """The exemplar config with ``policy.<key>=<value>`` overrides (dots in keys as ``__``), checked as
    every entry point checks it (pure checks, then the installed release)."""
    overrides = [f"policy.{key.replace('__', '.')}={_yaml(value)}" for key, value in policy_overrides.items()]
    return load_checked_config(overrides=overrides)


def _yaml(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def make_policy(**policy_overrides):
    """A freshly initialised policy in the already-initialised single-process megatron world."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nemo_rl_mtp.training.model import setup_megatron_policy

    cfg = tiny_config(**policy_overrides)
    model_parallel_cuda_manual_seed(cfg.policy.megatron_cfg.seed)
    torch.manual_seed(cfg.policy.megatron_cfg.seed)
    return setup_megatron_policy(cfg.policy, VOCAB_SIZE), cfg.policy


def make_batch(
    response_lengths: list[int],
    prompt_length: int = 5,
    seq_length: int = 16,
    sample_mask: list[float] | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A right-padded RL batch: prompt tokens, then response tokens (token_mask 1), then padding."""
    return synthetic_rl_batch(response_lengths, VOCAB_SIZE, prompt_length, seq_length, sample_mask, seed)


def gradients(policy) -> dict[str, torch.Tensor]:
    """Every parameter's accumulated gradient (DDP main_grad), by name."""
    return {name: param.main_grad.detach().clone() for name, param in policy.model.module.named_parameters()}


def mtp_parameter_names(policy) -> list[str]:
    return [name for name, _ in policy.model.module.named_parameters() if name.startswith("mtp.")]


def response_mask(rollouts: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, S] True on the response tokens of rollouts (after the prompt, before the end)."""
    positions = torch.arange(rollouts["tokens"].shape[1])[None, :]
    return (positions >= rollouts["prompt_lengths"][:, None]) & (positions < rollouts["lengths"][:, None])


def expected_draft_counts(policy, rollouts) -> tuple[int, int]:
    """Drafts proposed and accepted by greedy decoding with one draft per step, replayed from the
    training forward alone: the draft from position j predicts token j + 2; accepted, the next one
    comes from j + 2, else from j + 1; a draft counts only if its token is in the response
    (through its end of sequence), as vLLM counts them."""
    depth_one = eval_forward_logits(policy, rollouts["tokens"], response_mask(rollouts))[1][0].argmax(dim=-1)
    proposed = accepted = 0
    for row, (prompt_length, length) in enumerate(zip(rollouts["prompt_lengths"].tolist(), rollouts["lengths"].tolist())):
        position = prompt_length - 1
        while position + 2 < length:
            right = bool(depth_one[row, position] == rollouts["tokens"][row, position + 2])
            proposed, accepted = proposed + 1, accepted + right
            position += 2 if right else 1
    return proposed, accepted


def recompute_sampler(
    policy, prompts: list[list[int]], max_new_tokens: int, eos_id: int, temperature: float = 0.0, seed: int = 0
) -> list[list[int]]:
    """Sampling the slow, obvious way, as an oracle for the engine (and the "before" of its
    benchmark): for every new token, one full forward of all sequences (no KV cache, no
    speculation), then argmax (``temperature`` 0) or a draw from softmax(logits / temperature),
    over the real vocabulary. Returns each prompt followed by its response."""
    from nemo_rl_mtp.megatron_compat.cpu import training_runtime as cpu_runtime
    from nemo_rl_mtp.training.batches import causal_attention_mask
    from nemo_rl_mtp.training.module_modes import eval_mode

    model = policy.model.module
    generator = torch.Generator().manual_seed(seed)
    sequences = [list(prompt) for prompt in prompts]
    active = list(range(len(prompts)))
    with eval_mode(model), torch.no_grad(), cpu_runtime.device_scope():
        for _ in range(max_new_tokens):
            width = max(len(sequences[row]) for row in active)
            input_ids = torch.zeros(len(active), width, dtype=torch.long)
            for index, row in enumerate(active):
                input_ids[index, : len(sequences[row])] = torch.tensor(sequences[row])
            logits = model(
                input_ids=input_ids,
                position_ids=torch.arange(width).expand_as(input_ids),
                attention_mask=causal_attention_mask(width),
            )
            last = torch.tensor([len(sequences[row]) - 1 for row in active])
            logits = logits[torch.arange(len(active)), last, : policy.vocab_size].float()
            if temperature == 0.0:
                next_tokens = logits.argmax(dim=-1)
            else:
                next_tokens = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
            for row, token in zip(active, next_tokens.tolist()):
                sequences[row].append(token)
            active = [row for row in active if sequences[row][-1] != eos_id]
            if not active:
                break
    return sequences


def eval_forward_logits(policy, tokens: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The policy's logits [B, S, V] and each MTP depth's [B, S, V], from one eval-mode forward of
    megatron's GPTModel over plain rows (the MTP block's own output, through the output layer)."""
    from nemo_rl_mtp.training.module_modes import eval_mode

    with eval_mode(policy.model.module), torch.no_grad():
        return forward_logits(policy, tokens, loss_mask.float())


def forward_logits(policy, tokens: torch.Tensor, loss_mask: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward of megatron's GPTModel over plain rows, in the model's current mode and grad
    mode: the policy's logits [B, S, V] and each MTP depth's [B, S, V] (the MTP block's output
    through the output layer, with the weight megatron's MTP loss uses: the shared embedding when
    tied, detached for detached heads)."""
    from nemo_rl_mtp.megatron_compat.cpu import training_runtime as cpu_runtime
    from nemo_rl_mtp.training.batches import causal_attention_mask

    model = policy.model.module
    rows, length = tokens.shape
    captured = []
    hook = model.mtp.register_forward_hook(lambda module, inputs, output: captured.append(output))
    try:
        with cpu_runtime.device_scope():
            logits = model(
                input_ids=tokens,
                position_ids=torch.arange(length).expand(rows, length),
                attention_mask=causal_attention_mask(length),
                labels=None,
                loss_mask=loss_mask,
            )
    finally:
        hook.remove()
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else model.output_layer.weight
    if getattr(model.config, "mtp_detach_heads", False):  # a field since megatron-core 0.19
        weight = weight.detach()
    depths = captured[0].chunk(1 + model.config.mtp_num_layers, dim=0)[1:]
    return logits, [model.output_layer(hidden, weight=weight)[0].transpose(0, 1) for hidden in depths]


def task_demonstrations(task: str, digit_prompts: list[list[int]], tokenizer) -> dict[str, torch.Tensor]:
    """``demonstration_batch`` of a digit task: its prompts and correct answers."""
    prompts = [prompt_ids(task, digits, tokenizer) for digits in digit_prompts]
    answers = [answer_ids(expected_answer(task, digits), tokenizer) for digits in digit_prompts]
    return demonstration_batch(prompts, answers, tokenizer.pad_id)


def train_count_up(policy, cfg, steps: int = 40):
    """``steps`` seeded imitation steps of count_up (64 prompts of 2-3 digits each): the heads
    learn drafts that are often right. Returns ``policy``."""
    from nemo_rl_mtp.training.imitation import imitation_step
    from tests.support.engine_cases import TOKENIZER

    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        lengths = torch.randint(2, 4, (64,), generator=generator)
        digits = [torch.randint(0, 10, (int(n),), generator=generator).tolist() for n in lengths]
        imitation_step(policy, task_demonstrations("count_up", digits, TOKENIZER), cfg)
    return policy


# Independent runs (a GRPO run, another release's suite) started at once: each keeps about one of
# the machine's cores busy.
RUNS_AT_ONCE = 2


def release_of(item) -> str | None:
    """The megatron-core release a collected test item is parametrized with (``release``); None
    for an item without one, or for an empty parameter set, which pytest skips."""
    callspec = getattr(item, "callspec", None)
    release = callspec.params["release"] if callspec is not None and "release" in callspec.params else None
    return release if isinstance(release, str) else None
