"""Command-line entry points (``python -m nemo_rl_mtp.cli.<command>``)."""
