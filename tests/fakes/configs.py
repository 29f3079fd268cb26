"""Pipeline configs for tests: one builder with keyword overrides, and the set-ups built on it.

``pipeline_config()`` is what a user's pipeline.yaml holds, as a dict: one ``llm`` processor,
one JSONL dataset, one output. Each keyword replaces one default; the section keywords
(``processor``, ``dataset``, ``loading``, ``processing``) add or replace keys of that section, and
any other keyword is a whole top-level section::

    pipeline_config("in.jsonl", inputs=["text"], outputs=[{"name": "answer", "prompt": "{{ text }}"}],
                    processor={"backend": "openai", "base_url": url}, shard_params={"max_error_rate": 1.0})
"""

from __future__ import annotations

import json
from pathlib import Path

from mirageflow.config import load_config
from mirageflow.shard.runner import index_datasets

PLAIN = [{"name": "a", "prompt": "{{ q }}"}]  # one free-text output `a` from the input `q`


def pipeline_config(
    data: str | Path = "in.jsonl",
    *,
    inputs: list[str | dict] = ("q",),
    outputs: list[dict] = tuple(PLAIN),
    model: str | Path = "unused",
    state_dir: str | Path | None = "state",
    output_dir: str | Path = "out",
    num_shards: int | None = 1,
    processor: dict | None = None,
    dataset: dict | None = None,
    loading: dict | None = None,
    processing: dict | None = None,
    **sections: dict,
) -> dict:
    """A pipeline config dict. ``inputs``: names (each read from the row key of that name) or
    ``{"name", "key"}`` dicts; ``processor``/``dataset``/``loading``/``processing``: keys added to
    ``processors[0]``, ``loading_params.datasets[0]``, ``loading_params``, ``processing_params``;
    ``**sections``: top-level sections as given (``shard_params={...}``, ``execution_params={...}``).
    ``state_dir=None`` or ``num_shards=None`` leaves the key out (the schema's default)."""
    loading_params = {
        "state_dir": None if state_dir is None else str(state_dir),
        "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(output_dir), **(dataset or {})}],
        "num_shards": num_shards,
    }
    loading_params = {k: v for k, v in loading_params.items() if v is not None} | (loading or {})
    return {
        "processors": [{"type": "llm", "server_args": {"model_path": str(model)}, **(processor or {})}],
        "loading_params": loading_params,
        "processing_params": {
            "inputs": [{"name": i, "key": i} if isinstance(i, str) else dict(i) for i in inputs],
            "outputs": [dict(o) for o in outputs],
            **(processing or {}),
        },
        **sections,
    }


def shard_config(tmp_path: Path, rows: list, outputs: list[dict], output_schema: dict | None = None, num_shards: int = 1):
    """A loaded, indexed config over ``rows`` (dicts, or raw JSONL lines) written to tmp_path/in.jsonl,
    for driving ``run_shard`` directly: every row error tolerated, a commit every 2 rows."""
    data = tmp_path / "in.jsonl"
    data.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    cfg = load_config(pipeline_config(
        data, outputs=outputs, state_dir=tmp_path / "state", output_dir=tmp_path / "out", num_shards=num_shards,
        processing={"remove_columns": True, "output_schema": output_schema or {"q": "{{ q }}", "a": "{{ a }}"}},
        shard_params={"max_error_rate": 1.0, "checkpoint_rows": 2, "checkpoint_min_seconds": 0},
    ))  # fmt: skip
    index_datasets(cfg)
    return cfg


def merge_config(tmp_path: Path, num_shards: int, fmt: str = "parquet"):
    """A loaded config of one dataset (one row) and that dataset, for merge tests that write the
    shards' parts and status.json by hand (fakes.runs.finish_shard)."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"q": "x"}) + "\n")
    cfg = load_config(pipeline_config(
        src, model="m", state_dir=tmp_path / "state", output_dir=tmp_path / "out", num_shards=num_shards,
        dataset={"output_format": fmt},
    ), environ={})  # fmt: skip
    return cfg, cfg.datasets[0]
