"""Hugging Face checkpoints in and out through the real megatron-bridge, on tiny random checkpoints
in MiMo's layout written by ``scripts/tiny_mimo_checkpoint.py``; every expectation comes from the
checkpoint's files or from transformers' side (``tests/support/hf_reference.py``), never from the bridge."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nemo_rl_mtp.training.imitation import imitation_step
from nemo_rl_mtp.tasks.tokenizer import load_tokenizer
from nemo_rl_mtp.training import hf_checkpoint
from nemo_rl_mtp.config.load import ConfigError, resolve_checkpoint_keys
from nemo_rl_mtp.grpo.checked_config import check_run_config, load_checked_config
from tests.support.helpers import eval_forward_logits, task_demonstrations
from tests.support.hf_reference import hf_greedy, hf_logits, load_hf_model
from tests.support.release_gates import requires_megatron_bridge

REPO_ROOT = Path(__file__).resolve().parents[3]
from scripts.tiny_mimo_checkpoint import write_tiny_mimo_checkpoint  # noqa: E402

pytestmark = [pytest.mark.usefixtures("megatron_world"), requires_megatron_bridge()]
TOKENS = torch.tensor([[1, 12, 40, 7, 99, 200, 3, 17, 55, 8, 140, 2], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[int, Path]:
    """Tiny MiMo-layout checkpoints with 0, 1 and 2 MTP layers (different seeds)."""
    root = tmp_path_factory.mktemp("hf")
    return {layers: write_tiny_mimo_checkpoint(root / f"mtp{layers}", mtp_layers=layers, seed=layers) for layers in (0, 1, 2)}


def imported(checkpoint: Path, *overrides: str):
    """A policy built from ``checkpoint`` the way a worker builds it, after the driver resolved
    the config against it; returns (policy, resolved config, bridge)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nemo_rl_mtp.training.model import setup_megatron_policy

    cfg = load_checked_config(overrides=[f"policy.model_name={checkpoint}", "policy.trust_remote_code=true", "policy.max_total_sequence_length=32", *overrides])
    bridge = hf_checkpoint.open_checkpoint(str(checkpoint), True)
    cfg = resolve_checkpoint_keys(cfg, hf_checkpoint.checkpoint_facts(bridge, str(checkpoint)))
    check_run_config(cfg)
    model_parallel_cuda_manual_seed(cfg.policy.megatron_cfg.seed)
    tokenizer = load_tokenizer(str(checkpoint), True, cfg.data.apply_chat_template)
    return setup_megatron_policy(cfg.policy, tokenizer.vocab_size), cfg, bridge


def megatron_logits(policy) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return eval_forward_logits(policy, TOKENS, torch.ones_like(TOKENS))


def assert_mtp_logits_equal(megatron_depths: list[torch.Tensor], reference_depths: list[torch.Tensor]) -> None:
    """Depth d is compared where its input token t + d lies inside the sequence."""
    assert len(megatron_depths) == len(reference_depths) > 0
    for depth, (ours, theirs) in enumerate(zip(megatron_depths, reference_depths), start=1):
        torch.testing.assert_close(ours[:, :-depth], theirs[:, :-depth], rtol=0, atol=1e-5)


@pytest.mark.parametrize("mtp_layers, zeroing, zeroed", [(1, "auto", True), (2, "auto", True), (1, "false", False), (2, "false", False)])
def test_imported_model_computes_the_checkpoints_logits_and_mtp_logits(checkpoints, mtp_layers, zeroing, zeroed, caplog):
    """MiMo's MTP drafters in vLLM and SGLang zero the MTP embedding at position 0: ``auto`` trains
    that convention on a MiMo checkpoint (logged with why), ``false`` megatron's own; each equals
    the HF-side reference computed with the same convention, and the two references differ."""
    import logging

    with caplog.at_level(logging.INFO):
        policy, cfg, _ = imported(checkpoints[mtp_layers], f"policy.megatron_cfg.mtp_zero_embedding_at_position_0={zeroing}")
    assert cfg.policy.megatron_cfg.mtp_num_layers == mtp_layers  # from the checkpoint
    megatron_cfg = cfg.policy.megatron_cfg
    assert megatron_cfg.hidden_size == 64 and megatron_cfg.num_attention_heads == megatron_cfg.num_query_groups == 2
    if zeroed:
        assert "MTP token embedding at position 0: zeroed (auto: MiMoForCausalLM" in caplog.text
        assert "vLLM (mimo_mtp.py) and SGLang (mimo_mtp.py) zero the MTP embedding at position 0" in caplog.text
    else:
        assert "MTP token embedding at position 0: megatron's (not zeroed) (set to false in the config)" in caplog.text
    logits, depths = megatron_logits(policy)
    hf_model = load_hf_model(checkpoints[mtp_layers])[0]
    reference, reference_depths = hf_logits(hf_model, TOKENS, zero_position_0=zeroed)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
    assert_mtp_logits_equal(depths, reference_depths)
    _, other_convention = hf_logits(hf_model, TOKENS, zero_position_0=not zeroed)
    for depth, (ours, theirs) in enumerate(zip(depths, other_convention), start=1):
        assert (ours[:, :-depth] - theirs[:, :-depth]).abs().amax() > 1e-3  # the convention shows in every depth


@pytest.mark.parametrize("mtp_layers", [1, 2])
def test_import_then_export_gives_back_every_source_tensor_bit_for_bit(checkpoints, mtp_layers):
    policy, _, bridge = imported(checkpoints[mtp_layers])
    exported = hf_checkpoint.hf_state_dict(bridge, policy.model.module, mtp_layers)
    source = load_file(checkpoints[mtp_layers] / "model.safetensors")
    assert exported.keys() == source.keys()
    assert sum(".mtp_layers." in name for name in source) > 0
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("mtp_layers", [1, 2])
def test_trained_heads_export_and_the_hf_reference_drafts_what_megatron_drafts(checkpoints, mtp_layers, tmp_path):
    """After training steps, the converter's output loads on the HF side with no missing or
    unexpected keys, its MTP tensors have changed, and the HF-side reference computes the draft
    logits megatron computes from the checkpoint it saved."""
    from nemo_rl_mtp.training.checkpoint import save_policy
    from nemo_rl_mtp.training.hf_export import export_run_checkpoint

    policy, cfg, _ = imported(checkpoints[mtp_layers], "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16")
    tokenizer = load_tokenizer(str(checkpoints[mtp_layers]), True, True)
    for step in range(3):
        digits = [[(step + row) % 10, row % 7, 3] for row in range(16)]
        imitation_step(policy, task_demonstrations("reverse", digits, tokenizer), cfg.policy)
    save_policy(policy, tmp_path / "step_000003")
    out = export_run_checkpoint(cfg, tmp_path / "step_000003", tmp_path / "hf")

    model, info = load_hf_model(out)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == mtp_layers
    source, exported = load_file(checkpoints[mtp_layers] / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(not torch.equal(source[name], exported[name]) for name in source if name.endswith("mtp_layers.0.input_proj.weight"))
    _, depths = megatron_logits(policy)
    _, reference_depths = hf_logits(model, TOKENS, zero_position_0=True)  # auto: MiMo's serving convention
    assert_mtp_logits_equal(depths, reference_depths)


def test_a_checkpoint_without_mtp_weights_gets_new_heads_and_exports_them(checkpoints, tmp_path, caplog):
    """The trunk is the checkpoint's; the MTP layer is megatron's initialisation (logged), and the
    export carries it in MiMo's layout with the count key set."""
    import logging

    from nemo_rl_mtp.training.checkpoint import save_policy
    from nemo_rl_mtp.training.hf_export import export_run_checkpoint

    with caplog.at_level(logging.INFO):
        policy, cfg, _ = imported(checkpoints[0])
    assert cfg.policy.megatron_cfg.mtp_num_layers == 1  # the exemplar's, as a new layer
    assert "has no MTP weights: its 1 MTP layer(s) are new" in caplog.text
    logits, _ = megatron_logits(policy)
    torch.testing.assert_close(logits, hf_logits(load_hf_model(checkpoints[0])[0], TOKENS, zero_position_0=True)[0], rtol=0, atol=1e-5)
    save_policy(policy, tmp_path / "step_000000")
    out = export_run_checkpoint(cfg, tmp_path / "step_000000", tmp_path / "hf")
    model, info = load_hf_model(out)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    _, depths = megatron_logits(policy)
    assert_mtp_logits_equal(depths, hf_logits(model, TOKENS, zero_position_0=True)[1])  # auto: MiMo's serving convention


@pytest.mark.parametrize("num_speculative_tokens", [0, 1])
def test_greedy_rollouts_of_the_imported_model_equal_transformers_greedy_decoding(checkpoints, num_speculative_tokens):
    from nemo_rl_mtp.rollout.engine import RolloutEngine

    overrides = [f"policy.generation.num_speculative_tokens={num_speculative_tokens}", "policy.generation.max_new_tokens=12"]
    policy, cfg, _ = imported(checkpoints[1], *overrides)
    tokenizer = load_tokenizer(str(checkpoints[1]), True, True)
    prompts = [tokenizer.prompt_ids(text) for text in ("What is 17 + 25?", "reverse: 314 =", "Sort 9 1 5")]
    rollouts = RolloutEngine(policy, cfg.policy).generate(prompts, tokenizer.eos_id, tokenizer.pad_id, seed=0, greedy=True)
    model = load_hf_model(checkpoints[1])[0]
    ours = [row[:length].tolist() for row, length in zip(rollouts["tokens"], rollouts["lengths"])]
    assert ours == [hf_greedy(model, prompt, 12, tokenizer.eos_id) for prompt in prompts]
    assert all(len(row) > len(prompt) for row, prompt in zip(ours, prompts))


def resolved(checkpoint: Path, *overrides: str):
    """The driver's resolution of a config against a checkpoint (before any worker)."""
    from nemo_rl_mtp.grpo.run import resolve_model

    return resolve_model(load_checked_config(overrides=[f"policy.model_name={checkpoint}", "policy.max_total_sequence_length=32", *overrides]))


def test_conflicts_between_config_and_checkpoint_are_one_line_before_any_worker(checkpoints, tmp_path):
    trusted = "policy.trust_remote_code=true"
    cases = {
        "has 1 MTP layer(s) with weights": lambda: resolved(checkpoints[1], trusted, "policy.megatron_cfg.mtp_num_layers=2"),
        "no such directory": lambda: resolved(tmp_path / "missing", trusted),
        "set policy.trust_remote_code=true": lambda: resolved(checkpoints[1]),
        "exceeds the 512 positions": lambda: resolved(checkpoints[1], trusted, "policy.max_total_sequence_length=600"),
        "the architecture comes from policy.model_name": lambda: resolved(checkpoints[1], trusted, "policy.megatron_cfg.hidden_size=128"),
        "no config.json there": lambda: resolved(tmp_path, trusted),
    }
    for expected, resolve in cases.items():
        with pytest.raises(ConfigError) as error:
            resolve()
        assert expected in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert resolved(checkpoints[1], trusted, "policy.megatron_cfg.mtp_num_layers=1").policy.megatron_cfg.mtp_num_layers == 1


def test_a_tokenizer_without_an_end_of_sequence_token_is_refused(checkpoints, tmp_path):
    copy = Path(shutil.copytree(checkpoints[1], tmp_path / "no-eos"))
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["eos_token"] = None
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        load_tokenizer(str(copy), True, True)


def test_multi_latent_attention_is_refused_on_the_cpu(tmp_path):
    """A DeepSeek-V3-layout config (no weights needed to decide): one line naming the reason, where
    the driver knows the workers build the local spec (here, CPU workers of a cluster, or local
    asked for); with ``auto`` on a cluster's GPU workers each worker decides (its node may have
    transformer_engine where the driver has none): the driver does not refuse it."""
    from transformers import DeepseekV3Config

    DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1, num_nextn_predict_layers=1,
        architectures=["DeepseekV3ForCausalLM"],
    ).save_pretrained(tmp_path)  # fmt: skip
    cluster = "cluster.address=10.0.0.1:6379"
    for overrides in ((), (cluster,), (cluster, "cluster.gpus_per_worker=1", "policy.megatron_cfg.transformer_impl=local")):
        with pytest.raises(ConfigError, match="multi-latent attention, which megatron-core builds only with transformer_engine"):
            resolved(tmp_path, *overrides)
    # (load balancing off: 0.18 refuses it after the MLA check, which is what this line is about)
    deferred = resolved(tmp_path, cluster, "cluster.gpus_per_worker=1", "policy.megatron_cfg.moe_aux_loss_coeff=0")
    assert deferred.policy.model_name == str(tmp_path)


def test_a_qwen3_checkpoint_gets_new_heads_in_megatron_bridges_qwen3_mtp_layout(tmp_path, caplog):
    """A second architecture, transformers' own class (no remote code), with q/k layer norms: the
    trunk's logits and tensors come back exactly, and the new MTP layer is exported under the
    names megatron-bridge maps for Qwen3 (Qwen3-Next's ``mtp.*``)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from scripts.tiny_mimo_checkpoint import build_tokenizer

    config = Qwen3Config(
        vocab_size=336, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = Qwen3ForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    cfg = load_checked_config(overrides=[f"policy.model_name={tmp_path}", "policy.max_total_sequence_length=32"])
    bridge = hf_checkpoint.open_checkpoint(str(tmp_path), False)
    cfg = resolve_checkpoint_keys(cfg, hf_checkpoint.checkpoint_facts(bridge, str(tmp_path)))
    check_run_config(cfg)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nemo_rl_mtp.training.model import setup_megatron_policy

    import logging

    model_parallel_cuda_manual_seed(cfg.policy.megatron_cfg.seed)
    with caplog.at_level(logging.INFO):
        policy = setup_megatron_policy(cfg.policy, 320)
    assert "MTP token embedding at position 0: megatron's (not zeroed) (auto: Qwen3ForCausalLM (model_type qwen3)" in caplog.text
    assert policy.config.qk_layernorm and cfg.policy.megatron_cfg.mtp_num_layers == 1
    logits, _ = megatron_logits(policy)
    with torch.no_grad():
        torch.testing.assert_close(logits, reference(TOKENS).logits, rtol=0, atol=1e-5)
    exported = hf_checkpoint.hf_state_dict(bridge, policy.model.module, 1)
    source = reference.state_dict()
    assert all(torch.equal(exported[name], tensor) for name, tensor in source.items())
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_norm.weight"} <= exported.keys() - source.keys()


def test_the_driver_says_once_which_position_0_convention_the_heads_train_and_why(checkpoints, caplog):
    """Before any worker starts: a MiMo checkpoint under ``auto`` trains vLLM's and SGLang's
    convention; a GPT built from scratch does not."""
    import logging

    from nemo_rl_mtp.grpo.run import resolve_model

    with caplog.at_level(logging.INFO, logger="nemo_rl_mtp.grpo.run"):
        resolved(checkpoints[1], "policy.trust_remote_code=true")
        resolve_model(load_checked_config())
    lines = [record.getMessage() for record in caplog.records if "MTP token embedding at position 0" in record.getMessage()]
    assert lines == [
        "MTP token embedding at position 0: zeroed (auto: MiMoForCausalLM (model_type mimo): vLLM (mimo_mtp.py) and SGLang "
        "(mimo_mtp.py) zero the MTP embedding at position 0)",
        "MTP token embedding at position 0: megatron's (not zeroed) (auto: a GPT built from scratch, no serving engine's MTP "
        "drafter to match)",
    ]
