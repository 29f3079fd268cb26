"""The dataset card: README.md with the Hub's YAML header, and how the records were made.

The header is what the Hub's viewer and ``datasets.load_dataset(repo_id)`` read: one
config per dataset (and one more per deduplicated dataset), each with its Parquet files
under ``data/<config>/``, the license (``execution_params.license``), the size category
of its records, and ``mirageflow.pipeline_id``: which pipeline made the repo (``mmirage
publish`` refuses a repo whose card names another). The body: the records and where they
came from, the models with their revisions (and the commit the driver fetched), sampling,
prompts, the run's figures (rows, records, rows failed by class, tokens, throughput,
GPU-hours, dedup counts, findings), the pipeline config with its secrets removed, and
the mirageflow version and commit.

Every figure is read from metrics.json (``mirageflow.report.aggregate`` computes them;
nothing here derives one again) and the merge manifests; the card has no time stamp, so
the same run gives the same card: the one the card rule writes beside merged/ is the one
``mmirage publish`` uploads.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mirageflow.config.types import PipelineConfig
from mirageflow.errors import MirageflowError
from mirageflow.files import atomic_write_bytes, atomic_write_text
from mirageflow.numbers import fmt
from mirageflow.state import layout as L

DEDUP_SUFFIX = "-deduplicated"
# the Hub's size_categories, by the number of records (huggingface_hub's repocard metadata)
SIZE_CATEGORIES = (
    (1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"),
    (10_000_000, "1M<n<10M"), (100_000_000, "10M<n<100M"), (1_000_000_000, "100M<n<1B"),
)  # fmt: skip


class CardInputsMissing(MirageflowError, RuntimeError):
    """The card needs metrics.json (the aggregate rule) and a merge of every dataset."""


@dataclass
class CardInputs:
    """What a card is made of besides the config: metrics.json, and per dataset (by index)
    its records and the deduplication's counts; the shards a partial upload left out."""

    metrics: dict
    records: dict[int, int]
    dedup: dict[int, dict] = field(default_factory=dict)
    left_out: list[int] = field(default_factory=list)


def config_names(cfg: PipelineConfig) -> list[str]:
    """Each dataset's name in the repo (and in ``mmirage merge --output-dir``): its
    output_dir's folder name, ``<name>_<index>`` when two datasets share one."""
    names = [os.path.basename(os.path.normpath(ds.output_dir)) or f"dataset_{ds.index}" for ds in cfg.datasets]
    return [f"{name}_{ds.index}" if names.count(name) > 1 else name for ds, name in zip(cfg.datasets, names)]


def data_dir(name: str) -> str:
    """A config's folder in the repo."""
    return f"data/{name}"


def size_category(records: int) -> str:
    for bound, label in SIZE_CATEGORIES:
        if records < bound:
            return label
    return "n>1B"


def pipeline_id(state_dir: str | os.PathLike) -> str:
    """This pipeline's id (made once per state_dir), which its cards carry."""
    path = L.StateLayout(state_dir).pipeline_id
    atomic_write_bytes(path, (json.dumps({"pipeline_id": uuid.uuid4().hex}) + "\n").encode(), only_if_absent=True)
    try:
        return str(json.loads(path.read_text())["pipeline_id"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CardInputsMissing(f"{path}: damaged ({type(e).__name__}: {e}); delete it (the next card makes a new id)") from None


def source_commit() -> str | None:
    """The git commit of the mirageflow checkout running, when it is one."""
    root = Path(__file__).resolve().parents[3]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def read_inputs(cfg: PipelineConfig) -> CardInputs:
    """metrics.json, the merge manifests and the dedup counts of a run that merged every dataset."""
    paths = L.StateLayout(cfg.state_dir)
    metrics = read_metrics(cfg)
    records = {}
    for ds in cfg.datasets:
        manifest = _read_json(paths.merge_manifest(ds.index), "run the workflow (or mmirage merge) first: the merge rule writes it")
        records[ds.index] = int(manifest["rows"])
    return CardInputs(metrics, records, dedup_counts(cfg, metrics))


def read_metrics(cfg: PipelineConfig) -> dict:
    """metrics.json, which the aggregate rule writes (every figure of the card is its)."""
    return _read_json(L.StateLayout(cfg.state_dir).metrics, "run the workflow first: the aggregate rule writes it")


def dedup_counts(cfg: PipelineConfig, metrics: dict) -> dict[int, dict]:
    """Each deduplicated dataset's counts, as metrics.json lists them."""
    found = {}
    for entry in metrics.get("deduplication") or []:
        name = Path(str(entry.get("counts_file", ""))).name
        for ds in cfg.datasets:
            if name == L.StateLayout(cfg.state_dir).dedup_counts(ds.index).name and "error" not in entry:
                found[ds.index] = entry
    return found


def _read_json(path: Path, hint: str) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CardInputsMissing(f"{path} does not exist; {hint}") from None
    except (OSError, ValueError) as e:
        raise CardInputsMissing(f"{path}: cannot read ({type(e).__name__}: {e}); {hint}") from None


# --------------------------------------------------------------------------- the card


def header(cfg: PipelineConfig, inputs: CardInputs, pid: str) -> dict:
    configs, total = [], 0
    for ds, name in zip(cfg.datasets, config_names(cfg)):
        configs.append({"config_name": name, "data_files": [{"split": "train", "path": f"{data_dir(name)}/*.parquet"}]})
        total += inputs.records.get(ds.index, 0)
        if ds.index in inputs.dedup:
            dname = name + DEDUP_SUFFIX
            configs.append({"config_name": dname, "data_files": [{"split": "train", "path": f"{data_dir(dname)}/*.parquet"}]})
    head: dict = {}
    if cfg.execution.license:
        head["license"] = cfg.execution.license
    head |= {
        "size_categories": [size_category(total)],
        "tags": ["synthetic", "mirageflow"],
        "configs": configs,
        "mirageflow": {"pipeline_id": pid, "partial": bool(inputs.left_out)},
    }
    return head


def render_card(cfg: PipelineConfig, config_file: str | os.PathLike, inputs: CardInputs) -> str:
    """The card's text (deterministic: no time stamp)."""
    from mirageflow import __version__

    pid = pipeline_id(cfg.state_dir)
    agg = inputs.metrics.get("aggregate") or {}
    lines = ["---", yaml.safe_dump(header(cfg, inputs, pid), sort_keys=False).rstrip(), "---", ""]
    lines += [f"# {config_names(cfg)[0]}", ""]
    lines += [
        f"Records made by a [mirageflow](https://github.com/EPFLiGHT/MMIRAGE) pipeline (MMIRAGE format) with LLMs: "
        f"mirageflow {__version__}, commit {source_commit() or 'unknown'}. Everything below is generated from the run.",
        "",
    ]
    if inputs.left_out:
        lines += [f"**A partial dataset**: the records of shard(s) {inputs.left_out} of {agg.get('total_shards')} are not in it "
                  "(they failed or did not run).", ""]  # fmt: skip
    lines += _data_section(cfg, inputs)
    lines += _models_section(cfg)
    lines += _prompts_section(cfg)
    lines += _run_section(agg)
    lines += _dedup_section(cfg, inputs)
    from mirageflow.report.findings import findings_markdown

    lines += findings_markdown(inputs.metrics.get("findings") or [])
    lines += ["## Pipeline config", "", "Secrets removed.", "", "```yaml", _config_text(config_file).rstrip(), "```", ""]
    return "\n".join(lines)


def _data_section(cfg: PipelineConfig, inputs: CardInputs) -> list[str]:
    lines = ["## Data", "", "| config | from | records |", "|---|---|---|"]
    for ds, name in zip(cfg.datasets, config_names(cfg)):
        lines.append(f"| `{name}` | `{ds.path}`{f' ({ds.split})' if ds.split else ''} | {fmt(inputs.records.get(ds.index))} |")
        if ds.index in inputs.dedup:
            lines.append(f"| `{name}{DEDUP_SUFFIX}` | `{name}` without duplicates | {fmt(inputs.dedup[ds.index].get('rows_out'))} |")
    return lines + ["", f'```python\nfrom datasets import load_dataset\nds = load_dataset("<repo id>", "{config_names(cfg)[0]}")\n```', ""]


def _models_section(cfg: PipelineConfig) -> list[str]:
    from mirageflow import hub_models

    commits = {}
    for model in hub_models.hub_models(cfg):
        try:
            commits[model.processor_index] = json.loads(hub_models.marker_path(cfg.state_dir, model).read_text()).get("commit")
        except (OSError, ValueError):
            commits[model.processor_index] = None
    lines = ["## Models", "", "| processor | backend | model | revision | commit | default sampling |", "|---|---|---|---|---|---|"]
    for name, p in sorted(cfg.processors.items(), key=lambda kv: kv[1].index):
        sampling = json.dumps(p.sampling_params, sort_keys=True) if p.sampling_params else ""
        lines.append(
            f"| `{name}` | {p.backend} | `{p.server_args.model_path}` | {p.server_args.revision or ''} | "
            f"{commits.get(p.index) or ''} | `{sampling}` |"
        )
    for name, p in sorted(cfg.image_processors.items(), key=lambda kv: kv[1].index):
        lines.append(f"| `{name}` | {p.backend} | `{p.model_path}` | {p.revision or ''} | {commits.get(p.index) or ''} | |")
    return lines + [""]


def _prompts_section(cfg: PipelineConfig) -> list[str]:
    lines = ["## Prompts and sampling", "", f"Samples per source row (n_samples): {cfg.n_samples}.", ""]
    for out in cfg.outputs:
        kind = "JSON" if out.is_json else out.kind
        lines.append(f"### `{out.name}` ({kind}, processor `{out.processor}`)")
        lines.append("")
        if out.sampling_params:
            lines += [f"Sampling: `{json.dumps(out.sampling_params, sort_keys=True)}`", ""]
        if out.predicate:
            lines += [f"Keeps a row when `{out.predicate}`.", ""]
        for label, text in (("system", out.system), ("prompt", out.prompt), ("conversation", out.conversation)):
            if text:
                lines += [f"{label}:", "", "```jinja", text.rstrip(), "```", ""]
    return lines


def _run_section(agg: dict) -> list[str]:
    rows = [
        ("shards completed", f"{fmt(agg.get('completed_shards'))} of {fmt(agg.get('total_shards'))}"),
        ("source rows processed", fmt(agg.get("total_rows_processed"))),
        ("rows failed", fmt(agg.get("total_rows_failed"))),
        ("rows filtered out", fmt(agg.get("total_rows_filtered"))),
        ("input tokens", fmt(agg.get("total_input_tokens"))),
        ("output tokens", fmt(agg.get("total_output_tokens"))),
        ("wall clock", str(agg.get("wall_clock_runtime_human") or "n/a")),
        ("throughput (rows/s)", fmt(agg.get("overall_throughput_rows_per_sec"))),
        ("output tokens/s", fmt(agg.get("tokens_per_sec"))),
        ("output tokens/s per GPU", fmt(agg.get("tokens_per_sec_per_gpu"))),
        ("GPUs", f"{fmt(agg.get('num_gpus'))} {', '.join(agg.get('gpu_names') or [])}".rstrip()),
        ("GPU-hours (allocated)", fmt(agg.get("gpu_hours_allocated"))),
        ("GPU-days per billion output tokens", fmt(agg.get("gpu_days_per_billion_tokens_wall"))),
        ("cost (USD)", _cost(agg)),
    ]
    lines = ["## Run", "", "From the run's metrics.json.", "", "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    by_class = agg.get("rows_failed_by_class") or {}
    if by_class:
        lines += ["", "Rows failed by class:", "", "| class | rows |", "|---|---|"]
        lines += [f"| {k} | {fmt(v)} |" for k, v in sorted(by_class.items())]
    return lines + [""]


def _cost(agg: dict) -> str:
    """The run's spend as metrics.json has it (stats/pricing.py): tokens with no known price are
    said, never counted as free."""
    spent, unpriced = agg.get("cost_usd"), agg.get("cost_unpriced_tokens") or 0
    text = "n/a" if spent is None else f"${spent:,.4f}"
    return f"{text} (+ {fmt(unpriced)} tokens with no known price)" if unpriced else text


def _dedup_section(cfg: PipelineConfig, inputs: CardInputs) -> list[str]:
    if not inputs.dedup:
        return []
    lines = ["## Deduplication", "", "| config | records in | exact duplicates | near duplicates | records out |", "|---|---|---|---|---|"]
    for ds, name in zip(cfg.datasets, config_names(cfg)):
        c = inputs.dedup.get(ds.index)
        if c:
            lines.append(
                f"| `{name}{DEDUP_SUFFIX}` | {fmt(c.get('rows_in'))} | {fmt(c.get('exact_duplicates_removed'))} | "
                f"{fmt(c.get('near_duplicates_removed'))} | {fmt(c.get('rows_out'))} |"
            )
    return lines + [""]


def _config_text(config_file: str | os.PathLike) -> str:
    """The pipeline config as written, secrets moved out (as it is stored) and masked: the
    processors' keys named like secrets, URL passwords and query values, and every value
    registered as a secret (not ``processing_params.inputs[].key``, a JMESPath key)."""
    from mirageflow.config.loading import read_config_file
    from mirageflow.redact import redact, redact_text
    from mirageflow.state.pipeline import stored_config

    config = stored_config(read_config_file(config_file))[0]
    if isinstance(config.get("processors"), list):
        config["processors"] = redact(config["processors"])
    return redact_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))


def write_local_cards(cfg: PipelineConfig, config_file: str | os.PathLike, inputs: CardInputs | None = None) -> list[Path]:
    """The card beside merged/ in every output_dir of the pipeline (the card rule)."""
    text = render_card(cfg, config_file, read_inputs(cfg) if inputs is None else inputs)
    cards = L.dataset_cards(cfg)
    for path in cards:
        atomic_write_text(path, text)
    return cards
