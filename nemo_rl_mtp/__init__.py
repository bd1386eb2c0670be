"""MTP training for GRPO on megatron-core (see README.md and docs/architecture.md).

Importing the package only makes megatron-core's later import in this process skip importing
torch's compiler on a CPU (``megatron_compat/cpu/deferred_compile.py``); it imports neither.
"""

from nemo_rl_mtp.megatron_compat.cpu import deferred_compile as _deferred_compile

_deferred_compile.install()
