"""Write a tiny, randomly initialised Hugging Face checkpoint in MiMo's layout (a Qwen2 decoder
plus ``model.mtp_layers.N``; remote-code config with ``num_nextn_predict_layers``), with a small
byte-level BPE tokenizer and a chat template, for CPU recipes and tests of the import/export path.

    uv run python scripts/tiny_mimo_checkpoint.py --out checkpoints/tiny-mimo [--mtp-layers 1]

The tokenizer is trained on the text of the tasks the CPU recipes use (arithmetic questions, the
digit tasks rendered as text, chat scaffolding), digits one token each, as Qwen's tokenizers split
them; the checkpoint is written the way Xiaomi ships MiMo-7B: safetensors, ``config.json`` with
``auto_map`` to ``configuration_mimo.py`` / ``modeling_mimo.py`` next to it.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import shutil
import sys
from pathlib import Path

REMOTE_CODE = Path(__file__).resolve().parent / "tiny_mimo"
# Qwen's chat markup and special tokens: <|im_end|> ends a turn (the end-of-sequence token of chat
# models), <|endoftext|> pads.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ARCHITECTURE = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    # Two heads of 32: vLLM's CPU attention serves head sizes of 32 and up (16 raises
    # "Unsupported CPU attention configuration"), so the CPU recipes' exports serve (docs/serving.md).
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.02,
)


def training_corpus(seed: int = 0) -> list[str]:
    """Text the tokenizer's merges are learnt from: the recipes' tasks and the chat markup."""
    rng = random.Random(seed)
    lines = ["system", "user", "assistant", "The answer is", "What is", "Reverse", "Sort", "Count on from"]
    for _ in range(2000):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        lines.append(f"What is {a} {op} {b}? Give the answer as \\boxed{{}}.")
        lines.append(f"The answer is \\boxed{{{eval(f'{a}{op}{b}')}}}.")
    return lines


def build_tokenizer(seed: int = 0):
    """A byte-level BPE tokenizer (every digit its own token), as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(training_corpus(seed), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def _remote_code_module(out_dir: Path):
    """The copied ``modeling_mimo`` imported as a package, so its classes save their source with
    ``auto_map`` the way a remote-code checkpoint does."""
    package = f"tiny_mimo_remote_code_{abs(hash(str(out_dir)))}"
    spec = importlib.util.spec_from_file_location(package, out_dir / "__init__.py", submodule_search_locations=[str(out_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[package] = module
    spec.loader.exec_module(module)
    return importlib.import_module(f"{package}.modeling_mimo")


def write_tiny_mimo_checkpoint(out_dir: str | Path, mtp_layers: int = 1, seed: int = 0) -> Path:
    """Write the checkpoint into ``out_dir`` (created; replaced if it exists) and return it."""
    import torch

    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    code_dir = out_dir / "_code"
    code_dir.mkdir(parents=True)
    for name in ("configuration_mimo.py", "modeling_mimo.py"):
        shutil.copy(REMOTE_CODE / name, code_dir / name)
    (code_dir / "__init__.py").write_text("")
    modeling = _remote_code_module(code_dir)

    tokenizer = build_tokenizer(seed)
    # A vocabulary a little larger than the tokenizer's, as released checkpoints pad theirs.
    vocab_size = -(-len(tokenizer) // 16) * 16 + 16
    config = modeling.MiMoConfig(
        vocab_size=vocab_size,
        num_nextn_predict_layers=mtp_layers,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **ARCHITECTURE,
    )
    modeling.MiMoConfig.register_for_auto_class()
    modeling.MiMoForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    torch.manual_seed(seed)
    model = modeling.MiMoForCausalLM(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    shutil.rmtree(code_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write (replaced if it exists)")
    parser.add_argument("--mtp-layers", type=int, default=1, help="MTP layers (num_nextn_predict_layers; 0: none)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write_tiny_mimo_checkpoint(args.out, args.mtp_layers, args.seed)
    print(f"wrote {path} ({', '.join(sorted(p.name for p in path.iterdir()))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
