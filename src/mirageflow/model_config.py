"""A local model directory's ``config.json`` (Hugging Face format), read in one place.

The driver's preflight (context length, vision tower; also of a hub model's cached
config), the engines (vision processor) and the stats (KV-cache bytes per token for the
roofline) all read it through ``read``: a missing, unreadable or malformed file is
"unknown" (None), never an exception.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CONFIG_FILE = "config.json"

# where a model's context length is written, by model family
CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length", "max_sequence_length")
# keys only a vision-language model's config has
VISION_KEYS = ("vision_config", "vision_tower", "visual", "mm_vision_tower", "image_token_index", "image_token_id")


def path(model_dir: str | os.PathLike) -> Path:
    return Path(model_dir) / CONFIG_FILE


def read(model_dir: str | os.PathLike) -> dict | None:
    """The parsed config.json of a model directory, or None (no such file, unreadable, not a JSON object)."""
    try:
        data = json.loads(path(model_dir).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def language_config(config: dict) -> dict:
    """The language model's part of a config (multimodal configs nest it as ``text_config`` or ``llm_config``)."""
    for key in ("text_config", "llm_config"):
        if isinstance(config.get(key), dict):
            return config[key]
    return config


def read_with_source(model_dir: str | os.PathLike) -> tuple[dict, str] | None:
    """(config, where it was read) of a model directory, or None."""
    config = read(model_dir)
    return None if config is None else (config, str(path(model_dir)))


def context_length_of(config, source: str) -> tuple[int, str] | None:
    """(context length, where it was read) from a parsed config.json (read from ``source``), or None."""
    if not isinstance(config, dict):
        return None
    for scope in (config, config.get("text_config") or {}, config.get("llm_config") or {}):
        if not isinstance(scope, dict):
            continue
        for key in CONTEXT_KEYS:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, f"{key} in {source}"
    return None


def context_length(model_dir: str | os.PathLike) -> tuple[int, str] | None:
    """(context length, where it was read) from a model directory's config.json, or None."""
    found = read_with_source(model_dir)
    return None if found is None else context_length_of(*found)


def is_vision_config(config) -> bool | None:
    """Whether a parsed config.json describes a vision-language model; None when unknown."""
    if not isinstance(config, dict):
        return None
    return any(k in config for k in VISION_KEYS)


def is_vision(model_dir: str | os.PathLike) -> bool | None:
    """Whether a local model's config.json describes a vision-language model; None when unknown."""
    return is_vision_config(read(model_dir))
