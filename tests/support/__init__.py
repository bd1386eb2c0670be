"""What the tests share: tiny configs and policies (helpers), synthetic RL batches, the Hugging Face
reference model, release gates (skips that name what the installed megatron-core lacks), the
rollout engine cases, and an offline wandb. Benchmarks and scripts import from here too."""
