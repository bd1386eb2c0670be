"""Config loading: exemplar defaults, inheritance, overrides, and errors that name the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import nemo_rl_mtp

from nemo_rl_mtp.config.load import ConfigError, load_config
from nemo_rl_mtp.grpo.checked_config import load_pure_checked_config
from tests.support.release_gates import requires_megatron_bridge


def test_exemplar_loads_and_is_read_only():
    cfg = load_config()
    assert cfg.policy.megatron_cfg.mtp_num_layers >= 0
    with pytest.raises(Exception):
        cfg.policy.train_micro_batch_size = 3


def test_override_with_correct_type():
    cfg = load_config(overrides=["policy.megatron_cfg.mtp_num_layers=2", "policy.megatron_cfg.optimizer.lr=3e-4"])
    assert cfg.policy.megatron_cfg.mtp_num_layers == 2
    assert cfg.policy.megatron_cfg.optimizer.lr == pytest.approx(3e-4)


def test_recipe_inherits_through_defaults(tmp_path):
    (tmp_path / "base.yaml").write_text("policy:\n  megatron_cfg:\n    mtp_num_layers: 3\n    hidden_size: 128\n")
    (tmp_path / "child.yaml").write_text("defaults: base.yaml\npolicy:\n  megatron_cfg:\n    hidden_size: 96\n")
    cfg = load_config(tmp_path / "child.yaml", ["policy.train_micro_batch_size=8"])
    assert cfg.policy.megatron_cfg.mtp_num_layers == 3  # from base
    assert cfg.policy.megatron_cfg.hidden_size == 96  # child wins
    assert cfg.policy.train_micro_batch_size == 8  # override wins
    assert cfg.policy.megatron_cfg.num_layers == load_config().policy.megatron_cfg.num_layers  # exemplar


def test_recipe_outside_the_checkout_inherits_the_packaged_exemplar(tmp_path):
    """``defaults: grpo_mtp.yaml`` names the exemplar the package ships, not a file next to the
    recipe (there is none in tmp_path, and none in examples/configs either)."""
    (tmp_path / "recipe.yaml").write_text("defaults: grpo_mtp.yaml\npolicy:\n  megatron_cfg:\n    hidden_size: 96\n")
    cfg = load_config(tmp_path / "recipe.yaml")
    assert cfg.policy.megatron_cfg.hidden_size == 96
    exemplar = OmegaConf.load(Path(nemo_rl_mtp.__file__).parent / "config" / "grpo_mtp.yaml")
    assert cfg.policy.megatron_cfg.num_layers == exemplar.policy.megatron_cfg.num_layers
    assert cfg.grpo.max_num_steps == exemplar.grpo.max_num_steps


@pytest.mark.parametrize(
    "override, named",
    [
        ("policy.megatron_cfg.mtp_num_layerz=2", "mtp_num_layerz"),
        ("policy.megatron_cfg.mtp_num_layers=two", "policy.megatron_cfg.mtp_num_layers"),
        ("policy.sequence_packing.enabled=maybe", "policy.sequence_packing.enabled"),
        ("policy.megatron_cfg.params_dtype=fp8", "policy.megatron_cfg.params_dtype"),
        ("policy.megatron_cfg.mtp_num_layers=-1", "policy.megatron_cfg.mtp_num_layers"),
        ("policy.train_micro_batch_size=7", "policy.train_global_batch_size"),
        ("policy.megatron_cfg.recompute_granularity=full", "policy.megatron_cfg.recompute_method"),
        ("policy.generation.num_speculative_tokens=-1", "policy.generation.num_speculative_tokens"),
        (
            "policy.megatron_cfg.mtp_num_layers=0 policy.generation.num_speculative_tokens=1",
            "policy.generation.num_speculative_tokens",
        ),
        ("policy.generation.top_k=-1", "policy.generation.top_k"),
        ("policy.generation.top_k=1 policy.generation.top_p=0.9", "policy.generation.top_k"),
        ("policy.generation.engine.buffer_size_gb=0", "policy.generation.engine.buffer_size_gb"),
        ("policy.generation.engine.max_requests=0", "policy.generation.engine.max_requests"),
        # Each would otherwise fail late, inside the workers, or be accepted silently.
        ("policy.megatron_cfg.optimizer.lr=-1e-3", "policy.megatron_cfg.optimizer.lr=-0.001: must be in (0.0, inf)"),
        ("grpo.num_prompts_per_step=0", "grpo.num_prompts_per_step=0: must be in [1, inf)"),
        ("policy.megatron_cfg.num_attention_heads=0", "policy.megatron_cfg.num_attention_heads=0"),
        ("policy.megatron_cfg.tensor_model_parallel_size=0", "policy.megatron_cfg.tensor_model_parallel_size=0"),
        ("policy.train_global_batch_size=0", "policy.train_global_batch_size=0"),
        ("policy.megatron_cfg.num_query_groups=0", "policy.megatron_cfg.num_query_groups=0"),
        ("policy.megatron_cfg.optimizer.adam_beta1=1.5", "policy.megatron_cfg.optimizer.adam_beta1=1.5: must be in [0.0, 1.0)"),
        ("policy.megatron_cfg.optimizer.clip_grad=-1", "policy.megatron_cfg.optimizer.clip_grad"),
        ("policy.megatron_cfg.optimizer.weight_decay=-0.1", "policy.megatron_cfg.optimizer.weight_decay"),
        ("loss_fn.ratio_clip_min=1.5", "loss_fn.ratio_clip_min=1.5: must be in [0.0, 1.0)"),
        ("loss_fn.reference_policy_kl_penalty=-0.1", "loss_fn.reference_policy_kl_penalty"),
        ("cluster.workers_per_node=0", "cluster.workers_per_node=0"),
        ("checkpointing.save_period=0", "checkpointing.save_period=0"),
        ("env.name=chess", "env.name='chess' is not one of ['digits', 'math']"),
        ("env.name=math", "env.name='math': judges text, which needs a tokenizer: set policy.model_name"),
        ("env.name=math policy.model_name=x", "data.train_data_path=None: env.name=math takes its prompts from JSONL files"),
        ("data.train_data_path=t.jsonl", "data.train_data_path='t.jsonl': the digits environment makes its own prompts"),
        ("data.overlong_prompts=drop", "data.overlong_prompts='drop' is not one of ['skip', 'truncate']"),
        ("env.math.verify_timeout_s=0", "env.math.verify_timeout_s=0.0: must be in (0.0, inf)"),
        ("policy.megatron_cfg.activation=null", "policy.megatron_cfg.activation=None: a model built from scratch needs it"),
        ("policy.model_name=x policy.megatron_cfg.num_layers=4", "policy.megatron_cfg.num_layers=4: the architecture comes from policy.model_name=x"),
        ("policy.megatron_cfg.mtp_loss_type=kl", "policy.megatron_cfg.mtp_loss_type='kl' is not one of"),
        (
            "policy.megatron_cfg.mtp_loss_type=total_variation policy.megatron_cfg.context_parallel_size=2",
            "policy.megatron_cfg.mtp_loss_type='total_variation': needs context_parallel_size=1",
        ),
        ("policy.megatron_cfg.mtp_num_layers=0 policy.mtp_frozen_during_rl=true", "policy.mtp_frozen_during_rl=True: needs MTP heads"),
        ("grpo.warmup_distractor_fraction=0.5", "grpo.warmup_distractor_fraction=0.5: must be > 0 exactly when"),
        ("grpo.warmup_distractor_task=sort", "grpo.warmup_distractor_fraction=0.0: must be > 0 exactly when"),
        ("grpo.warmup_distractor_task=reverse grpo.warmup_distractor_fraction=0.5", "grpo.warmup_distractor_task='reverse': must differ"),
        ("grpo.warmup_distractor_task=sort grpo.warmup_distractor_fraction=1.5", "grpo.warmup_distractor_fraction=1.5: must be in [0.0, 1.0]"),
        (
            "env.name=math policy.model_name=x grpo.warmup_distractor_task=sort grpo.warmup_distractor_fraction=0.5",
            "grpo.warmup_distractor_task='sort': distractor demonstrations are digit tasks' answers; env.name=math has none",
        ),
        # model_class=hybrid: the layer pattern against the other keys, and the CPU.
        ("policy.megatron_cfg.model_class=hybrid", "policy.megatron_cfg.hybrid_layer_pattern=None: model_class=hybrid needs a layer pattern"),
        ('policy.megatron_cfg.hybrid_layer_pattern="*-*-/*-"', "policy.megatron_cfg.hybrid_layer_pattern='*-*-/*-': only model_class=hybrid reads"),
        ('policy.megatron_cfg.model_class=hybrid policy.megatron_cfg.num_layers=4 policy.megatron_cfg.hybrid_layer_pattern="M*M-/*-"', "policy.megatron_cfg.hybrid_layer_pattern='M*M-/*-': Mamba (mamba_ssm, causal-conv1d) layers need CUDA kernels"),
        ('policy.megatron_cfg.model_class=hybrid policy.megatron_cfg.num_layers=4 policy.megatron_cfg.hybrid_layer_pattern="G*G-/*-"', "policy.megatron_cfg.hybrid_layer_pattern='G*G-/*-': GatedDeltaNet (fla) layers need CUDA kernels"),
        ('policy.megatron_cfg.model_class=hybrid policy.megatron_cfg.num_layers=4 policy.megatron_cfg.hybrid_layer_pattern="*X*-/*-"', "policy.megatron_cfg.hybrid_layer_pattern='*X*-/*-': ['X'] not layer symbols"),
        ('policy.megatron_cfg.model_class=hybrid policy.megatron_cfg.num_layers=4 policy.megatron_cfg.hybrid_layer_pattern="*-*-*-/*-"', "policy.megatron_cfg.num_layers=4: hybrid_layer_pattern='*-*-*-/*-' has 6 decoder layers"),
        ('policy.megatron_cfg.model_class=hybrid policy.megatron_cfg.num_layers=4 policy.megatron_cfg.hybrid_layer_pattern="*-*-"', "policy.megatron_cfg.hybrid_layer_pattern='*-*-': 0 MTP layer pattern(s) after '/', but policy.megatron_cfg.mtp_num_layers=1"),
        ('policy.megatron_cfg.model_class=hybrid policy.megatron_cfg.num_layers=4 policy.megatron_cfg.hybrid_layer_pattern="*E*E/*E"', "policy.megatron_cfg.hybrid_layer_pattern='*E*E/*E': E (mixture of experts) layers need"),
        (
            'policy.megatron_cfg.model_class=hybrid policy.megatron_cfg.num_layers=4 policy.megatron_cfg.hybrid_layer_pattern="*E*E/*-" '
            "policy.megatron_cfg.num_moe_experts=4",
            "policy.megatron_cfg.hybrid_layer_pattern='*E*E/*-': with E layers in the decoder every MTP layer needs one too",
        ),
        ('policy.megatron_cfg.model_class=hybrid policy.megatron_cfg.num_layers=4 policy.megatron_cfg.hybrid_layer_pattern="*-*-/*-" policy.megatron_cfg.num_moe_experts=4', "policy.megatron_cfg.num_moe_experts=4: model_class=hybrid puts experts in E layers only"),
        ("policy.megatron_cfg.model_class=hybrid policy.model_name=x", "policy.megatron_cfg.model_class='hybrid': builds a model from hybrid_layer_pattern; policy.model_name=x"),
        ('policy.megatron_cfg.model_class=hybrid policy.megatron_cfg.num_layers=4 policy.megatron_cfg.hybrid_layer_pattern=*-*-/*-', "override 'policy.megatron_cfg.hybrid_layer_pattern=*-*-/*-': its value is not YAML"),
        # Measured: layers 10-20 logged loss 0.0 and acceptance 0% at every step, without a word.
        ("policy.megatron_cfg.mtp_num_layers=20", "MTP layers 10-20 would never get a target; use at most 9"),
    ],
)
def test_bad_values_are_rejected_naming_the_key(override, named):
    """By the pure checks (generic and the task's): no release is asked."""
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_pure_checked_config(overrides=override.split())


def test_the_deepest_mtp_layer_that_can_get_a_target_is_accepted():
    """Prompts of at most 4 digits are 6 tokens, plus 5 response tokens: the last response token
    sits at position 10, and depth 9 predicts it from position 0."""
    assert load_config(overrides=["policy.megatron_cfg.mtp_num_layers=9"]).policy.megatron_cfg.mtp_num_layers == 9


@requires_megatron_bridge()
def test_with_a_checkpoint_the_mtp_layer_count_waits_for_it_unless_set():
    """The driver fills in the checkpoint's count (resolve_checkpoint_keys); one set is checked against it."""
    assert load_config(overrides=["policy.model_name=x"]).policy.megatron_cfg.mtp_num_layers is None
    assert load_config(overrides=["policy.model_name=x", "policy.megatron_cfg.mtp_num_layers=2"]).policy.megatron_cfg.mtp_num_layers == 2
    assert load_config().policy.megatron_cfg.mtp_num_layers == 1


def test_unknown_key_in_a_recipe_names_file_and_key(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("policy:\n  megatron_cfg:\n    mtp_layers: 2\n")
    with pytest.raises(ConfigError, match=r"recipe\.yaml.*policy\.megatron_cfg\.mtp_layers"):
        load_config(recipe)


def test_defaults_cycle_and_missing_file_are_errors(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: b.yaml\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")



def test_malformed_yaml_is_one_line_naming_file_and_line(tmp_path):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("policy:\n  megatron_cfg:\n    mtp_num_layers: [1\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: not valid YAML \(line \d+\)") as error:
        load_config(recipe)
    assert "\n" not in str(error.value)
