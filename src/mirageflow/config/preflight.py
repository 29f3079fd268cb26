"""Checks that read the pipeline's files, run where the user starts a run: before any job.

``load_config`` (mirageflow.config) checks the config itself and is run by every job too,
so it touches no data or model file beyond a few ``stat`` calls. The checks here read a
little of each dataset and each model directory, once, in the Snakemake driver
(workflow/rules/common.smk, under ``workflow.is_main_process``: a cluster job re-parsing
the Snakefile skips them) and in ``mmirage check``. Both call ``validate``, so both refuse
the same configs with the same ``key.path: message`` lines:

- each dataset's format, from its first bytes (``PAR1`` vs text): a Parquet file declared
  JSONL, a JSONL (or gzip, or JSON array) file declared Parquet;
- each input's JMESPath key against the first ``SAMPLE_ROWS`` rows of each dataset: a key
  that matches none of them is refused (with a row that lacks it), unless the input has a
  ``default`` or ``optional: true``; likewise a ``preserve_columns`` name (with
  ``remove_columns: true``) that is a column of none of them;
- each local model: the directory exists and holds a config.json; a Hugging Face id
  (``org/name``) is in the cache at its revision, or the hub answers for it from here (the
  driver's ``hub_model`` rule will download it before any shard), else it is refused with
  the reason (offline, unknown id or revision, gated) and the fix (mirageflow.hub_models;
  ``hub_model_notes`` says which of them are cached or will be downloaded);
  ``max_new_tokens`` must be below the model's context (its config.json, cached or read
  from the hub);
- image inputs go to a model whose config.json declares a vision tower;
- ``api_key_env`` names a variable set in this environment (the jobs inherit it);
- the package a backend runs (sglang, vllm, diffusers) is installed in this Python, or a
  ``server_command``'s program exists (the jobs run in the driver's environment:
  docs/cluster.md; ``MIRAGEFLOW_SKIP_ENGINE_CHECK=1`` skips it where they do not);
- a custom processor's script imports and defines its ``function_name`` (the driver imports it);
- ``num_shards`` is at most the largest dataset's row count when it is cheap to know
  (Parquet footers, a JSONL file up to ``COUNT_JSONL_MAX_BYTES``, an existing index);
- no output_dir belongs to another pipeline (the owner marker, read only).

Every check that cannot decide (a file it cannot read, a format it does not know) stays
silent: the job that reads the data reports the real error, naming the file.
"""

from __future__ import annotations

import difflib
import glob
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Mapping

from mirageflow import hub_models
from mirageflow import model_config as model_files
from mirageflow.config.loading import ConfigError, load_config
from mirageflow.config.types import CustomProcessor, DatasetConfig, ImageGenProcessor, PipelineConfig, ProcessorConfig
from mirageflow.files import open_regular, path_hint
from mirageflow.data.dedup import dedup_problems, text_field_sample_problems
from mirageflow.engines import registry
from mirageflow.state.layout import StateLayout

log = logging.getLogger(__name__)

SAMPLE_ROWS = 20
IMPORT_TIMEOUT_SECONDS = 120.0  # a custom processor's script, imported once by the driver
COUNT_JSONL_MAX_BYTES = 64 << 20  # newline count of a JSONL file up to this size (~20 ms)
MAX_FILES_SNIFFED = 200
PARQUET_MAGIC = b"PAR1"
GZIP_MAGIC = b"\x1f\x8b"
# Model directories the workflow builds itself (workflow/rules/models.smk): not there before the first run.
WORKFLOW_BUILT_MODELS = hub_models.WORKFLOW_BUILT_MODELS
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's, used by every backend (schema: sampling_params)


def validate(
    source: Mapping | str | os.PathLike,
    *,
    environ: Mapping[str, str] | None = None,
    preflight: bool = True,
    built_models: tuple[str, ...] = WORKFLOW_BUILT_MODELS,
) -> PipelineConfig:
    """``load_config`` plus, with ``preflight``, the checks that read data and model files.

    The one validation of ``snakemake`` (the driver) and ``mmirage check``. Raises
    ConfigError listing every problem with its key path.
    """
    label = None if isinstance(source, Mapping) else str(source)
    cfg = load_config(source, environ=environ)
    if preflight:
        problems = preflight_problems(cfg, environ=environ, built_models=built_models)
        if problems:
            raise ConfigError(problems, label)
    return cfg


def preflight_problems(
    cfg: PipelineConfig, *, environ: Mapping[str, str] | None = None, built_models: tuple[str, ...] = WORKFLOW_BUILT_MODELS
) -> list[str]:
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    rows_known: list[int | None] = []
    for ds in cfg.datasets:
        where = ds.key
        found, sample, rows = _inspect_dataset(ds, where)
        problems += found
        if not found and sample:
            problems += _key_problems(cfg, ds, sample)
            problems += text_field_sample_problems(cfg, ds, sample)
        indexed = _indexed_rows(cfg, ds)
        rows_known.append(indexed if indexed is not None else rows)
    if rows_known and None not in rows_known and cfg.num_shards > max(rows_known):
        most = max(rows_known)
        counts = ", ".join(f"datasets[{i}]: {'at most ' if r is not None else ''}{r}" for i, r in enumerate(rows_known))
        problems.append(
            f"loading_params.num_shards: {cfg.num_shards} shards, but no dataset has more than {most} rows ({counts}); "
            f"shards beyond {max(most, 1)} would have no rows to process: use num_shards <= {max(most, 1)}"
        )
    processors = sorted([*cfg.processors.values(), *cfg.custom_processors.values(), *cfg.image_processors.values()], key=lambda p: p.index)
    for proc in processors:
        if isinstance(proc, CustomProcessor):
            problems += _custom_problems(proc)
        elif isinstance(proc, ImageGenProcessor):
            problems += _image_processor_problems(cfg, proc, environ)
        else:
            problems += _processor_problems(cfg, proc, environ, built_models)
    problems += _owner_problems(cfg)
    problems += budget_problems(cfg, rows_known, environ)
    missing_xgrammar = _xgrammar_problems(cfg)
    problems += missing_xgrammar or _json_prefix_problems(cfg)  # that check compiles grammars with xgrammar
    problems += dedup_problems(cfg)
    return problems


XGRAMMAR_INSTALL = "pip install --no-deps -r requirements-no-deps.txt (README.md, Quick start)"


def dataset_rows(cfg: PipelineConfig) -> list[int | None]:
    """Each dataset's rows: its index's count, else the count (or bound) its first look finds; None: unknown."""
    out = []
    for ds in cfg.datasets:
        indexed = _indexed_rows(cfg, ds)
        out.append(indexed if indexed is not None else _inspect_dataset(ds, ds.key)[2])
    return out


def over_budget_allowed(cfg: PipelineConfig, environ: Mapping[str, str]) -> bool:
    return cfg.execution.allow_over_budget or environ.get(ALLOW_OVER_BUDGET_ENV, "") in ("1", "true", "yes")


ALLOW_OVER_BUDGET_ENV = "MIRAGEFLOW_ALLOW_OVER_BUDGET"


def budget_forecast(cfg: PipelineConfig, rows_known: list[int | None] | None = None):
    """The whole run's cost forecast from a preview of the first rows (shard/preview.py
    cost_of_preview), or None when nothing is priced above 0 or the size is unknown."""
    from mirageflow.stats.pricing import FREE, processor_price

    if all(processor_price(p) == FREE for p in cfg.processors.values()):
        return None  # nothing costs: no preview to make
    from mirageflow.shard.preview import cost_of_preview, preview

    result = preview(cfg)
    return cost_of_preview(cfg, result, dataset_rows(cfg) if rows_known is None else rows_known)


def budget_problems(cfg: PipelineConfig, rows_known: list[int | None], environ: Mapping[str, str]) -> list[str]:
    """execution_params.max_cost_usd below the run's forecast: refused unless allowed (a warning then)."""
    cap = cfg.execution.max_cost_usd
    if cap is None:
        return []
    try:
        forecast = budget_forecast(cfg, rows_known)
    except Exception as e:  # noqa: BLE001 - a preview that cannot run: the shards report the real error
        log.warning("execution_params.max_cost_usd: no cost forecast (the preview failed: %s: %s)", type(e).__name__, e)
        return []
    if forecast is None or forecast.total_usd is None or forecast.total_usd <= cap:
        return []
    text = (
        f"execution_params.max_cost_usd: the run is forecast to cost ~${forecast.total_usd:,.2f} ({forecast.basis}"
        f", each request at its estimate: its text's characters / 4 at the input price, its max_new_tokens at the output price), "
        f"over the cap of ${cap:,.2f}: raise max_cost_usd, or set execution_params.allow_over_budget: true "
        f"(or {ALLOW_OVER_BUDGET_ENV}=1) to run anyway, the budget stopping the spending at the cap"
    )
    if over_budget_allowed(cfg, environ):
        log.warning("%s", text)
        return []
    return [text]


def _xgrammar_problems(cfg: PipelineConfig) -> list[str]:
    """JSON outputs that need xgrammar where it is not installed: constrained decoding on the
    transformers backend (``auto`` falls back to it), and any response_prefix (its
    continuation grammar). The CPU install puts it in a second step without its
    dependencies (requirements-no-deps.txt), which is easy to miss."""
    import importlib.util

    if importlib.util.find_spec("xgrammar") is not None:
        return []
    problems = []
    for i, out in enumerate(cfg.outputs):
        if not out.is_json:
            continue
        backend = cfg.processors[out.processor].backend
        if registry.capabilities(backend).grammar_in_process or out.response_prefix:
            problems.append(
                f"processing_params.outputs[{i}]: JSON output '{out.name}' (processor '{out.processor}', backend {backend}) "
                f"is constrained to its schema by the xgrammar package, which is not installed here: {XGRAMMAR_INSTALL}"
            )
    return problems


def _json_prefix_problems(cfg: PipelineConfig) -> list[str]:
    """A JSON output's response_prefix must start JSON valid against its schema: engines
    constrain only the continuation (engines/json_prefix.py). Here, in the driver only,
    because compiling the grammar imports xgrammar (~3 s with torch), which every cluster
    job re-parsing the workflow would pay; and only for a prefix the pure-Python check
    (json_prefix.certainly_starts) cannot vouch for."""
    import json

    problems = []
    for i, out in enumerate(cfg.outputs):
        if not (out.is_json and out.response_prefix and out.schema is not None):
            continue
        from mirageflow.engines.json_prefix import certainly_starts, continuation_grammar

        schema = out.schema.json_schema()
        if certainly_starts(schema, out.response_prefix):  # the usual prefixes, without importing xgrammar (and torch)
            continue
        try:
            continuation_grammar(json.dumps(schema), out.response_prefix)
        except ValueError as e:
            problems.append(
                f"processing_params.outputs[{i}].response_prefix: {e} "
                "(the answer is prefix + the model's continuation, constrained to the schema)"
            )
    return problems


# --------------------------------------------------------------------------- datasets


def _head(path: str, n: int = 4) -> bytes | None:
    try:
        with open_regular(path) as f:  # never a FIFO: opening one waits for a writer
            return f.read(n)
    except (OSError, ValueError):
        return None


def _inspect_dataset(ds: DatasetConfig, where: str) -> tuple[list[str], list[dict], int | None]:
    """(problems, first rows, row count or an upper bound, None when unknown)."""
    try:
        if ds.type == "jsonl":
            return _inspect_jsonl(ds.path, where)
        if ds.type == "parquet":
            return _inspect_parquet(ds.path, where)
        return _inspect_loadable(ds, where)
    except Exception:  # noqa: BLE001 - undecided: the index job reports the real error
        return [], [], None


def _inspect_jsonl(path: str, where: str) -> tuple[list[str], list[dict], int | None]:
    head = _head(path, 4)
    if head is None:
        return [], [], None
    if head.startswith(PARQUET_MAGIC):
        return [f"{where}.type: '{path}' is a Parquet file (it starts with PAR1), not JSONL: set type: Parquet"], [], None
    if head.startswith(GZIP_MAGIC):
        return [f"{where}.path: '{path}' is gzip-compressed; JSONL datasets must be uncompressed text: decompress it"], [], None
    rows: list[dict] = []
    seen = 0
    first = None
    with open_regular(path) as f:
        for line in f:
            if not line.strip():
                continue
            seen += 1
            first = first if first is not None else line
            try:
                value = json.loads(line)
            except ValueError:
                value = None
            if isinstance(value, dict):
                rows.append(value)
            if seen >= SAMPLE_ROWS:
                break
    if seen and not rows:
        text = first.decode("utf-8", "replace").strip()
        what = "a JSON array or pretty-printed JSON, not one object per line" if text[:1] in "[{" else "not JSON Lines"
        return (
            [f"{where}.path: none of the first {seen} non-empty lines of '{path}' is a JSON object: {what} (first line: {text[:80]!r})"],
            [],
            None,
        )
    size = os.path.getsize(path)
    count = None
    if size <= COUNT_JSONL_MAX_BYTES:  # newlines (+1 for a last line without one): at least the rows
        with open_regular(path) as f:
            data = f.read()
        count = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    return [], rows, count


def _parquet_paths(path: str) -> list[str]:
    from mirageflow.data.readers import parquet_files

    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        return parquet_files(path)
    return sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))


def _inspect_parquet(path: str, where: str) -> tuple[list[str], list[dict], int | None]:
    files = _parquet_paths(path)
    if not files and os.path.isdir(path):
        jsonl = sorted(glob.glob(os.path.join(path, "**", "*.jsonl"), recursive=True))
        if jsonl:
            return (
                [
                    f"{where}.type: directory '{path}' has no .parquet files but JSONL files ({jsonl[0]}, ...): set type: JSONL with one file each"
                ],
                [],
                None,
            )
        return [f"{where}.path: directory '{path}' holds no .parquet files"], [], None
    problems = []
    for f in files[:MAX_FILES_SNIFFED]:
        head = _head(f, 4)
        if head is None or head.startswith(PARQUET_MAGIC) or not head:
            continue
        if head.startswith(GZIP_MAGIC):
            why = "is gzip-compressed, not Parquet"
        elif head.lstrip()[:1] in (b"{", b"["):
            why = "is JSON text, not Parquet (it does not start with PAR1): set type: JSONL"
        else:
            why = f"is not a Parquet file (it starts with {head!r}, not PAR1)"
        problems.append(f"{where}.type: '{f}' {why}")
        break
    if problems or not files:
        return problems, [], None
    import pyarrow.parquet as pq

    from mirageflow.data.readers import arrow_rows

    pf = pq.ParquetFile(files[0])
    rows = []
    for batch in pf.iter_batches(batch_size=SAMPLE_ROWS):
        import pyarrow as pa

        rows = [r for r in arrow_rows(pa.Table.from_batches([batch]), files[0], 0) if isinstance(r, dict)]
        break
    count = None
    if len(files) <= MAX_FILES_SNIFFED:
        count = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    return [], rows, count


def _inspect_loadable(ds: DatasetConfig, where: str) -> tuple[list[str], list[dict], int | None]:
    """A save_to_disk directory, read with pyarrow (no `datasets` import: it costs seconds)."""
    root = Path(ds.path)
    split_dir = root
    if (root / "dataset_dict.json").exists():
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        if ds.split is None and len(splits) != 1:
            return [f"{where}.split: '{ds.path}' holds splits {splits}; set one"], [], None
        if ds.split is not None and ds.split not in splits:
            return [f"{where}.split: '{ds.path}' has no split '{ds.split}' (has {splits})"], [], None
        split_dir = root / (ds.split if ds.split is not None else splits[0])
    state = json.loads((split_dir / "state.json").read_text())
    files = [split_dir / f["filename"] for f in state.get("_data_files", [])]
    if not files or len(files) > MAX_FILES_SNIFFED:
        return [], [], None
    import pyarrow as pa

    rows: list[dict] = []
    count = 0
    for f in files:
        with pa.memory_map(str(f)) as source:
            reader = pa.ipc.open_stream(source)
            for batch in reader:
                if len(rows) < SAMPLE_ROWS:
                    rows += batch.slice(0, SAMPLE_ROWS - len(rows)).to_pylist()
                count += batch.num_rows
    if state.get("_indices_data_files"):  # a filtered/shuffled view: rows differ from the files'
        return [], [], None
    return [], rows, count


def _indexed_rows(cfg: PipelineConfig, ds: DatasetConfig) -> int | None:
    """The row count from this dataset's index, when it exists for this path (built by the index rule)."""
    try:
        header = json.loads(StateLayout(cfg.state_dir).dataset_index(ds.index).read_text())
        if header.get("path") == ds.path and isinstance(header.get("rows"), int):
            return header["rows"]
    except (OSError, ValueError, AttributeError):
        pass
    return None


def _key_paths(value: Any, prefix: str = "", depth: int = 3) -> list[str]:
    out = []
    if isinstance(value, dict) and depth:
        for k, v in value.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            out.append(path)
            out += _key_paths(v, path, depth - 1)
    return out


def _key_problems(cfg: PipelineConfig, ds: DatasetConfig, sample: list[dict]) -> list[str]:
    from mirageflow.prompts.templates import compile_jmespath

    problems = []
    for j, var in enumerate(cfg.inputs):
        if var.has_default or var.optional:
            continue
        try:
            expr = compile_jmespath(var.key)
        except ValueError:
            continue  # load_config reported it
        errors = []
        for row in sample:
            try:
                if expr.search(row) is not None:
                    break
            except Exception as e:  # noqa: BLE001 - a JMESPath function on the wrong type
                errors.append(f"{type(e).__name__}: {e}")
        else:
            shown = json.dumps(sample[0], ensure_ascii=False, default=str)
            shown = shown if len(shown) <= 300 else shown[:300] + "..."
            keys = _key_paths(sample[0])
            hint = difflib.get_close_matches(var.key, keys, n=1)
            problems.append(
                f"processing_params.inputs[{j}].key: '{var.key}' (input '{var.name}') matches nothing in the first "
                f"{len(sample)} rows of {ds.key} ('{ds.path}')"
                + (f": {errors[0]}" if errors else "")
                + (f" (did you mean '{hint[0]}'?)" if hint else "")
                + f"; row 0 is {shown}. Fix the key, or set default: (a value for rows without it) or optional: true"
            )
    for name in cfg.preserve_columns if cfg.remove_columns else ():  # a misspelt column would be null in every record
        if sample and not any(isinstance(row, dict) and name in row for row in sample):
            hint = difflib.get_close_matches(name, [str(k) for k in sample[0]] if isinstance(sample[0], dict) else [], n=1)
            problems.append(
                f"processing_params.preserve_columns: '{name}' is a column of none of the first {len(sample)} rows of "
                f"{ds.key} ('{ds.path}')" + (f" (did you mean '{hint[0]}'?)" if hint else "")
            )
    if not cfg.remove_columns:  # the rows' columns go into the records: one named like a workflow field would be overwritten
        from mirageflow.prompts.templates import RESERVED_RECORD_FIELDS, same_index

        for name in RESERVED_RECORD_FIELDS:
            # a source_index column holding each row's own index (MMIRAGE's recovery files) loses nothing
            # (the sample is the dataset's first rows, in order)
            if any(
                isinstance(row, dict) and name in row and not (name == "source_index" and same_index(row[name], i))
                for i, row in enumerate(sample)
            ):
                problems.append(
                    f"processing_params.remove_columns: false, but the rows of loading_params.datasets[{ds.index}] "
                    f"('{ds.path}') have a column '{name}', which the workflow writes into every record (its value "
                    "would be lost): set remove_columns: true (and preserve_columns for the columns to keep)"
                )
    return problems


# --------------------------------------------------------------------------- models


def hub_model_states(cfg: PipelineConfig, environ: Mapping[str, str] | None = None) -> list[hub_models.ModelState]:
    """Each hub model id of the config: cached, to be downloaded by the driver, or not obtainable."""
    environ = os.environ if environ is None else environ
    cache = hub_models.cache_dir(cfg, environ)
    return [hub_models.look_up(m, cache, environ) for m in hub_models.hub_models(cfg)]


def hub_model_notes(cfg: PipelineConfig, environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per hub model id that can be had (cached, or downloaded before any shard), for the driver's log and
    `mmirage check` (the others are problems)."""
    return hub_models.describe([s for s in hub_model_states(cfg, environ) if s.state != "cannot"])


# The jobs run in the driver's Python environment (docs/cluster.md, "What you need"), so the
# engine a backend needs is looked for here (find_spec, shutil.which: nothing is imported).
# Where the jobs' environment really differs (a compute node's module), this opts out.
SKIP_ENGINE_CHECK = "MIRAGEFLOW_SKIP_ENGINE_CHECK"


def _program_problem(key: str, program: str, environ: Mapping[str, str]) -> str | None:
    """Why a launcher program cannot be started by the jobs, or None."""
    import shutil

    if os.sep in program:
        path = os.path.expanduser(program)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return None
        why = "is not an executable file" if os.path.exists(path) else "does not exist"
        return f"{key}: program '{program}' {why}; the jobs start it: install it or fix the path"
    if shutil.which(program, path=environ.get("PATH", os.defpath)):
        return None
    return f"{key}: program '{program}' is not on PATH here (the jobs inherit this PATH): install it, or give its full path"


def engine_problems(where: str, backend: str, server_command, environ: Mapping[str, str]) -> list[str]:
    """The engine package (or launcher program) a backend needs, where the jobs will run it.
    ``where`` is the processor's key path (``processors[0]``)."""
    import importlib.util

    if environ.get(SKIP_ENGINE_CHECK):
        return []
    if server_command:
        problem = _program_problem(f"{where}.server_command", server_command[0], environ)
        return [problem] if problem else []
    if backend == registry.AUTO:
        return []  # picks what is installed on the node
    entry = registry.backend_entry(backend)
    if entry.package is None or importlib.util.find_spec(entry.package) is not None:
        return []
    instead = " (or server_command, the launcher to run instead)" if entry.launched else ""
    return [
        f"{where}.backend: {backend} needs the {entry.package} package, which this Python ({sys.executable}) does not have; "
        f"the jobs run in this environment: {entry.install}{instead}. If the jobs' environment differs and has it, "
        f"set {SKIP_ENGINE_CHECK}=1 to skip this check"
    ]


def _processor_problems(cfg: PipelineConfig, proc: ProcessorConfig, environ: Mapping[str, str], built_models: tuple[str, ...]) -> list[str]:
    where = f"processors[{proc.index}]"
    problems = []
    if registry.capabilities(proc.backend).loads_model:
        # auto: which backend (and so whether server_command is run) is the node's to decide
        command = proc.launch.command if proc.launch is not None and proc.backend != registry.AUTO else None
        problems += engine_problems(where, proc.backend, command, environ)
    if not registry.capabilities(proc.backend).loads_model:  # a remote server: its API key, no model files
        name = proc.api_key_env
        if name and not environ.get(name):
            problems.append(
                f"{where}.api_key_env: environment variable ${name} is not set (or empty) here; the jobs inherit this "
                f"environment: export {name}=... before starting the run"
            )
        return problems  # model_path is a name the server knows, not a local directory
    model_path = proc.server_args.model_path
    path = os.path.expanduser(model_path)
    model_config: tuple[dict, str] | None = None  # (config.json, where it was read)
    if os.path.normpath(path) in {os.path.normpath(m) for m in built_models}:
        if model_files.path(path).is_file():  # built by a rule otherwise
            model_config = model_files.read_with_source(path)
    elif os.path.isdir(path):
        if not model_files.path(path).is_file():
            problems.append(
                f"{where}.server_args.model_path: directory '{path}' holds no model (no config.json); "
                "point it at a Hugging Face model directory (config.json, tokenizer and weights)"
            )
        else:
            model_config = model_files.read_with_source(path)
    elif os.path.exists(path):
        problems.append(f"{where}.server_args.model_path: '{path}' is a file, not a model directory")
    elif hub_models.is_hub_id(model_path, built_models):
        model = hub_models.HubModel(proc.index, model_path, proc.server_args.revision)
        state = hub_models.look_up(model, hub_models.cache_dir(cfg, environ), environ)
        if state.state == "cannot":
            problems.append(f"{where}.server_args.model_path: '{model.label}' {state.detail}")
        elif state.config is not None:
            source = str(state.snapshot / "config.json") if state.snapshot else f"config.json of {model.label} on the hub"
            model_config = (state.config, source)
    else:
        hint = hub_models.revision_hint(model_path, f"{where}.server_args.revision") or path_hint(path)
        problems.append(f"{where}.server_args.model_path: model directory '{path}' does not exist{hint}")
    if proc.server_args.revision and not hub_models.is_hub_id(model_path, built_models):
        problems.append(
            f"{where}.server_args.revision: '{proc.server_args.revision}' is a revision of a Hugging Face model id, but "
            f"model_path '{model_path}' is a local path (a directory has no revisions): remove revision"
        )
    problems += _context_problems(cfg, proc, model_config)
    problems += _vision_problems(cfg, proc, model_config)
    return problems


def _image_processor_problems(cfg: PipelineConfig, proc: ImageGenProcessor, environ: Mapping[str, str]) -> list[str]:
    """An image_gen processor: the package or launcher its backend runs, and its model."""
    where = f"processors[{proc.index}]"
    problems = []
    if environ.get(SKIP_ENGINE_CHECK) or proc.backend == "external":
        pass  # an images server already running elsewhere: nothing runs here
    elif proc.backend == "diffusers":
        import importlib.util

        if importlib.util.find_spec("diffusers") is None:
            problems.append(
                f"{where}.backend: image_gen backend diffusers needs the diffusers package, which this Python "
                f"({sys.executable}) does not have: pip install diffusers (if the jobs' environment differs and has it, "
                f"set {SKIP_ENGINE_CHECK}=1)"
            )
    elif proc.server_command:  # sglang, launched by the shard
        problems += engine_problems(f"{where}.sglang", proc.backend, proc.server_command, environ)
    else:
        from mirageflow.imagegen.http_images import sglang_diffusion_missing

        missing = sglang_diffusion_missing()
        if missing:
            problems.append(
                f"{where}.backend: image_gen backend sglang launches SGLang's diffusion server, but {missing} "
                f"(or set sglang.server_command; if the jobs' environment differs and has it, set {SKIP_ENGINE_CHECK}=1)"
            )
    return problems + _image_model_problems(cfg, proc, environ)


def _image_model_problems(cfg: PipelineConfig, proc: ImageGenProcessor, environ: Mapping[str, str]) -> list[str]:
    """An image_gen processor's API key variable (external), its diffusers model
    (diffusers, sglang: a directory with model_index.json, or a hub id the driver fetches)."""
    where = f"processors[{proc.index}]"
    if proc.backend == "external":
        name = proc.api_key_env
        if name and not environ.get(name):
            return [
                f"{where}.external.api_key_env: environment variable ${name} is not set (or empty) here; export {name}=... before starting the run"
            ]
        return []
    key = f"{where}.{'pipeline_args' if proc.backend == 'diffusers' else 'sglang'}.model_path"
    path = proc.model_path or ""
    if os.path.isdir(path):
        if not (Path(path) / "model_index.json").is_file():
            return [f"{key}: directory '{path}' holds no diffusers pipeline (no model_index.json)"]
        return []
    if os.path.exists(path):
        return [f"{key}: '{path}' is a file, not a diffusers model directory"]
    model = hub_models.image_hub_model(proc)
    if model is not None:  # fetched by the driver (rule hub_model), as an LLM's hub id
        state = hub_models.look_up(model, hub_models.cache_dir(cfg, environ), environ)
        return [f"{key}: '{model.label}' {state.detail}"] if state.state == "cannot" else []
    block = "pipeline_args" if key.endswith("pipeline_args.model_path") else "sglang"
    hint = hub_models.revision_hint(path, f"{where}.{block}.revision") or path_hint(path)
    return [f"{key}: model directory '{path}' does not exist{hint}"]


def _custom_problems(proc: CustomProcessor) -> list[str]:
    """A custom processor's script imports and defines its function (the import runs the
    script's top level here, once, as every worker will)."""
    path = proc.script_path  # expanded by load_config
    if not proc.function_name or not os.path.isfile(path):
        return []  # load_config reported it
    from mirageflow.prompts.user_code import load_problem

    # in a process of its own: a script that exits, hangs or crashes at import cannot take the driver with it
    problem = load_problem(path, proc.function_name, timeout=IMPORT_TIMEOUT_SECONDS)
    if problem is None:
        return []
    kind, why = problem
    if kind == "function":
        return [f"processors[{proc.index}].function_name: {why}"]
    return [f"processors[{proc.index}].script_path: cannot import '{path}': {why}"]


def _vision_problems(cfg: PipelineConfig, proc: ProcessorConfig, model_config: tuple[dict, str] | None) -> list[str]:
    """Image inputs sent to a model whose config.json declares no vision tower (a text-only model)."""
    images = [(j, v) for j, v in enumerate(cfg.inputs) if v.type == "image"]
    served = any(o.processor == proc.type for o in cfg.outputs)
    if not images or not served or model_config is None or model_files.is_vision_config(model_config[0]) is not False:
        return []
    return [
        f"processing_params.inputs[{j}].type: image input '{v.name}', but processors[{proc.index}].server_args.model_path "
        f"'{proc.server_args.model_path}' is a text-only model (its config.json declares no vision tower): "
        "use a vision-language model, or drop the image input"
        for j, v in images
    ]


def _context_problems(cfg: PipelineConfig, proc: ProcessorConfig, model_config: tuple[dict, str] | None) -> list[str]:
    i = proc.index
    given = proc.server_args.extra_engine_args.get("context_length")
    if isinstance(given, int) and given > 0:
        context, source = given, f"processors[{i}].server_args.extra_engine_args.context_length"
    else:
        found = model_files.context_length_of(*model_config) if model_config is not None else None
        if found is None:
            return []
        context, source = found
    default = proc.sampling_params.get("max_new_tokens")
    checks = [
        (
            f"processors[{i}].default_sampling_params.max_new_tokens",
            default if default is not None else DEFAULT_MAX_NEW_TOKENS,
            default is None,
        )
    ]
    for j, out in enumerate(cfg.outputs):
        value = out.sampling_params.get("max_new_tokens")
        if value is not None and out.processor == proc.type:
            checks.append((f"processing_params.outputs[{j}].sampling_params.max_new_tokens", value, False))
    problems = []
    for where, value, implicit in checks:
        if value >= context:
            problems.append(
                f"{where}: {value}{' (the default)' if implicit else ''} is not below the model's context of {context} "
                f"tokens ({source}): no room is left for the prompt, every row would fail; use at most {context - 1} "
                "minus the longest prompt"
            )
    return problems


# --------------------------------------------------------------------------- output_dir owners


def _owner_problems(cfg: PipelineConfig) -> list[str]:
    from mirageflow.state import pipeline as pipeline_state

    try:
        pipeline_state.check_output_owners(cfg)
    except pipeline_state.OwnershipError as e:
        return str(e).splitlines()
    return []
