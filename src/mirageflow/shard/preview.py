"""``mmirage preview``: try a pipeline's prompts on the first rows of each dataset.

Preview is the record: the first ``rows`` rows of every dataset go through the shard's own
row path (``shard.rows.RowPath`` with the steps of ``shard/steps/``,
``shard.feed.pending`` and the shard's ``RecordRenderer``, ``preserve_columns``
included), so every record shown is the one a shard would write, field for field, with
``source_index`` and, with ``n_samples > 1``, one record per sample with its
``sample_index``. Beside each record: the extracted variables, each prompt exactly as the
engine receives it (the model's chat template applied through the engine's
``chat_prompt``) and the sample's seed.

Without ``--generate`` no model is loaded: a transformers, sglang or sglang_server
processor loads only its tokenizer (for the chat template); an openai or vllm_server one
sends chat messages and the server applies its own template, so the messages are shown. An output's
answer is then a placeholder, so later prompts and the record show where it goes; filter
and Python steps are not run.

With ``generate=True`` the configured engine is loaded and the rows are generated as a
shard does it: one answer per sample (one request with ``n`` on engines with native n),
the parsed JSON and each row's error. Engine logs go to a temporary directory; the
pipeline's state_dir and output_dirs are never read or written; transformers' progress
bars ("Loading weights") are off while the engine loads.

``export_prompts`` (``mmirage run --export-prompts``) runs every row the same way without
generation and writes each request as the engine would receive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

from mirageflow.config.types import DatasetConfig, PipelineConfig, ProcessorConfig
from mirageflow.engines import registry
from mirageflow.engines.base import Engine
from mirageflow.engines.wire import Completion, EngineInfo
from mirageflow.shard import feed, samples
from mirageflow.prompts.images import RowImages
from mirageflow.errors import RowError
from mirageflow.prompts.templates import Extractor, RecordRenderer
from mirageflow.shard.rows import RowPath
from mirageflow.shard.steps import python as python_steps
from mirageflow.shard.steps.base import FILTERED, Unit
from mirageflow.shard.steps.image import ImageStep
from mirageflow.shard.steps.llm import LLMStep
from mirageflow.state.remaining import CostForecast
from mirageflow.stats import formulas as stats

DEFAULT_ROWS = 3
NOT_GENERATED = "not_generated"  # the finish reason of a template-only engine's placeholder answer


class NotGenerated:
    """Stands for an output's answer in a preview without generation: any attribute or
    item of it is another placeholder, and it prints as ``<name: not generated>``."""

    def __init__(self, label: str):
        self._label = label

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return NotGenerated(f"{self._label}.{name}")

    def __getitem__(self, key):
        return NotGenerated(f"{self._label}[{key!r}]")

    def __str__(self) -> str:
        return f"<{self._label}: not generated>"

    __repr__ = __str__


class TemplateOnlyEngine(Engine):
    """The engine's chat template without its model: the tokenizer only (or nothing for an
    OpenAI-compatible server, which templates the messages itself). Its answers are empty
    placeholders, which ``PlaceholderStep`` turns into ``NotGenerated`` values."""

    def __init__(self, processor: ProcessorConfig):
        self.processor = processor
        self.backend = registry.resolve_backend(processor.backend)
        self.templates_server_side = registry.capabilities(self.backend).templates_server_side
        self.info = EngineInfo(backend=self.backend, model_path=processor.server_args.model_path)

    def load(self) -> None:
        if self.templates_server_side or not self.processor.apply_chat_template:
            return
        from transformers import AutoTokenizer

        args = self.processor.server_args
        self.tokenizer = AutoTokenizer.from_pretrained(args.model_path, trust_remote_code=args.trust_remote_code)

    async def generate_one(self, request):
        return Completion(request.id, "", 0, 0, NOT_GENERATED)


class PlaceholderStep(LLMStep):
    """An LLM output without generation: its value is a placeholder."""

    def assign(self, variables: dict, c: Completion) -> None:
        variables[self.output.name] = NotGenerated(self.output.name)
        if self.keep_reasoning:
            variables[self.reasoning_name] = NotGenerated(self.reasoning_name)


class SkippedFilter(python_steps.FilterStep):
    """A filter without generation: not run (its predicate may name answers not generated); the row goes on."""

    async def run(self, variables: dict, unit: Unit) -> bool:
        return True


class SkippedCustom(python_steps.CustomStep):
    """A Python step without generation: not run; its value is a placeholder."""

    async def run(self, variables: dict, unit: Unit) -> bool:
        variables[self.output.name] = NotGenerated(self.output.name)
        return True


class ShownImage(ImageStep):
    """An image output in a preview: its prompt rendered, no image generated or written (its
    variables are placeholders for later steps)."""

    async def run(self, variables: dict, unit: Unit) -> tuple[str]:
        prompt = self.prompt.render(variables)
        for name in self.names:
            variables[name] = NotGenerated(name)
        return (prompt,)  # what RowPath.observe hands to UnitTrace (a 1-tuple: true, so the row goes on)


class Unbooked:
    """The row path's metrics, counting nothing a preview reports."""

    def __init__(self):
        self.tracker = stats.InflightTracker()

    def book(self, request, completion, sent=True, cached=False, processor=None, choice_prompt=None) -> None:
        pass  # a preview's answers are shown, not counted (shard/metrics.py ShardMetrics.book counts them)

    def rendered(self, ds_index, row_index, sample, tally) -> None:
        pass  # nor its records (a shard commits theirs with their tally: shard/tally.py)


def first_rows(ds: DatasetConfig, n: int) -> list:
    """The dataset's first ``n`` rows as SourceRow (a dict, or a RowError for an unreadable row)."""
    return list(iter_rows(ds, n))


def _first_jsonl_rows(ds: DatasetConfig, n: int):
    """The first ``n`` rows of a JSONL dataset, or all of them when the file has fewer."""
    from mirageflow.data import readers

    try:
        yield from readers.read_shard(ds, readers.ShardSlice(0, n, 0, 1))
    except readers.DatasetEndedEarly:
        return


def iter_rows(ds: DatasetConfig, n: int = sys.maxsize):
    """The dataset's first ``n`` rows (default: all; fewer when it has fewer), read as they are consumed."""
    from mirageflow.data import readers

    if n <= 0:
        return iter(())
    if ds.type == "jsonl":
        if n == sys.maxsize:  # all rows: the reader checks it reads exactly as many as the file has
            return readers.read_shard(ds, readers.ShardSlice(0, readers.jsonl_count(ds.path), 0, 1))
        return _first_jsonl_rows(ds, n)
    if ds.type == "parquet":
        import pyarrow.parquet as pq

        files, total = [], 0
        for path in readers.dataset_files(ds):
            rows = pq.ParquetFile(path).metadata.num_rows
            files.append({"path": path, "rows": rows})
            total += rows
            if total >= n:
                break
        return readers.read_shard(ds, readers.ShardSlice(0, min(n, total), files=files))
    total = len(readers.load_hf(ds))  # memory-mapped: the length costs nothing
    return readers.read_shard(ds, readers.ShardSlice(0, min(n, total)))


def _plain(value: Any) -> Any:
    """A JSON-able copy (placeholders as their text)."""
    if isinstance(value, NotGenerated):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _error(e: RowError) -> dict:
    out = {"stage": e.stage, "error": e.kind, "message": str(e)}
    if e.raw is not None:
        out["raw"] = e.raw
    return out


@contextlib.contextmanager
def quiet_progress_bars():
    """transformers' (and the Hugging Face hub's) tqdm bars off, as they were after."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


class UnitTrace:
    """What ``RowPath.observe`` saw of each unit (row, or row and sample) of one dataset."""

    def __init__(self, ds_index: int, n: int, generate: bool):
        self.ds_index, self.n, self.generate = ds_index, n, generate
        self.steps: dict[tuple, list] = {}

    def __call__(self, row, sample, step, variables: dict, outcome) -> None:
        for k in sample if isinstance(sample, list) else [sample]:
            self.steps.setdefault((row.index, k), []).append((step, variables, outcome))

    def outputs(self, row_index: int, sample: int | None) -> list[dict]:
        out = []
        for step, variables, outcome in self.steps.get((row_index, sample), []):
            name = step.output.name
            entry: dict[str, Any] = {
                "name": name,
                "kind": step.output.kind,
                "processor": step.output.processor,
                "json": step.output.is_json,
            }
            if step.output.kind == "image_gen":  # its prompt shown, never generated: a preview writes no file
                entry["prompt"] = outcome[0]
                out.append(entry)
                continue
            if not step.calls_engine:  # a filter or Python step, run only with generate
                if self.generate:
                    entry["value"] = _plain(variables.get(name)) if step.output.kind == "custom" else outcome
                out.append(entry)
                continue
            request, completion = outcome
            entry["messages"] = request.messages
            if request.images:  # in placeholder order
                entry["images"] = [
                    {"source": im.source, "width": im.width, "height": im.height, "sha256": im.sha256} for im in request.images
                ]
            entry["prompt"] = request.prompt  # None: the server applies its chat template to the messages
            entry["sampling_params"] = request.sampling_params
            if request.seed is not None:  # this sample's own seed (shard/samples.py)
                entry["seed"] = samples.sample_seed(step.base_seed, self.ds_index, row_index, sample or 0)
            if self.generate:
                entry.update(
                    answer=completion.text, finish_reason=completion.finish_reason,
                    prompt_tokens=completion.prompt_tokens, completion_tokens=completion.completion_tokens,
                )  # fmt: skip
                if name in variables:  # set by the step (absent when the answer was the row's error)
                    entry["value"] = _plain(variables[name])
            out.append(entry)
        return out


def _unit(path: RowPath, trace: UnitTrace, row, sample, record, error) -> dict:
    out: dict[str, Any] = {"source_index": row.index}
    if sample is not None:
        out["sample_index"] = sample
    try:
        out["variables"] = None if isinstance(row.value, RowError) else _plain(path.extract(row.value))
    except RowError:
        out["variables"] = None
    out["outputs"] = trace.outputs(row.index, sample)
    out["record"] = None if record is None or record is FILTERED else _plain(record)
    if record is FILTERED:
        out["filtered"] = True  # the shard writes no record for this row (sample)
    out["error"] = None if error is None else _error(error)
    return out


async def _preview_dataset(path: RowPath, steps: list, ds, source: list, generate: bool) -> list[dict]:
    """Each unit of the dataset's first rows through the shard's row path, as RowFeeder._worker (shard/row_feeder.py) runs them."""
    trace = UnitTrace(ds.index, path.n, generate)
    path.observe = trace

    def read(skip):
        return iter(source)

    async def unit(row, sample) -> list[tuple]:
        if isinstance(sample, list):  # a row's samples, the first LLM step asked once (RowPath.row_samples)
            results = await path.row_samples(row, steps, ds.index, sample)
        else:
            results = [await path.one(row, steps, ds.index, sample)]
        return [(row, k, record, error) for k, record, error in results]

    units = feed.pending(ds.index, read, lambda u: False, path.n, path.grouped is not None)
    done = await asyncio.gather(*(unit(row, sample) for _, row, sample in units))
    return [_unit(path, trace, *outcome) for outcomes in done for outcome in outcomes]


class _Session:
    """What a preview needs for its rows: the shard's row path with its steps (engines loaded
    with ``generate``, else their chat templates only and placeholder steps); close() stops them."""

    def __init__(self, cfg: PipelineConfig, generate: bool, log_dir: str | Path | None, engine_factory=registry.create_engine):
        self.cfg, self.generate = cfg, generate
        always = [f"{o.name}_{k}" for o in cfg.outputs if o.kind == "image_gen" for k in ("path", "seed")]
        render = RecordRenderer(
            cfg.output_schema, cfg.remove_columns, [o.name for o in cfg.outputs if o.kind != "filter"], cfg.preserve_columns, always
        )  # fmt: skip
        self.path = RowPath(Extractor(cfg.inputs), RowImages.from_config(cfg), render, Unbooked(), cfg.n_samples)
        self.engines: dict[str, Engine] = {}
        self.pools: dict[str, python_steps.FunctionPool] = {}
        self._scratch = None
        if generate and log_dir is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="mmirage-preview-")
            log_dir = self._scratch.name
        try:
            if generate:
                self.pools = python_steps.start_pools(cfg.custom_processors, cfg.outputs)
            else:  # not started: the steps are shown, not run
                self.pools = {name: python_steps.FunctionPool(p) for name, p in cfg.custom_processors.items()}
            with quiet_progress_bars():
                for name in dict.fromkeys(o.processor for o in cfg.outputs if o.kind == "llm"):
                    processor = cfg.processors[name]
                    if generate and processor.batch is not None:
                        raise RuntimeError(
                            f"processor '{name}' sends its requests to {processor.batch.provider}'s batch API, whose answers take up "
                            "to 24 h: preview without --generate shows its requests"
                        )
                    engine = (
                        engine_factory(processor, cfg.batch_size, log_dir=Path(log_dir) / name)
                        if generate
                        else TemplateOnlyEngine(processor)
                    )
                    self.engines[name] = engine
                    engine.load()
            steps = [python_steps.make_step(o, lambda o: _model_step(cfg, o, self.engines), self.pools) for o in cfg.outputs]
            self.steps = [_placeholder(step, cfg) if not generate or step.output.kind == "image_gen" else step for step in steps]
            self.path.set_steps(self.steps)
        except BaseException:
            self.close()
            raise

    def rows(self, ds, source: list) -> list[dict]:
        """One entry per record the shard would write for these rows (per sample with n_samples > 1)."""
        return asyncio.run(_preview_dataset(self.path, self.steps, ds, source, self.generate)) if source else []

    def close(self) -> None:
        python_steps.close_pools(self.pools)
        for engine in self.engines.values():
            try:
                engine.close()
            except Exception:
                pass
        if self._scratch is not None:
            self._scratch.cleanup()


def preview(
    cfg: PipelineConfig,
    rows: int = DEFAULT_ROWS,
    generate: bool = False,
    log_dir: str | Path | None = None,
    engine_factory=registry.create_engine,
) -> dict:
    """{"datasets": [{index, path, rows: [...]}], "generated": bool, "n_samples": n, "engines": {...}}:
    the records a shard would write for the first ``rows`` rows of each dataset, one entry per
    record (per sample with n_samples > 1), with the prompts (and, with ``generate``, what the
    engine answered)."""
    session = _Session(cfg, generate, log_dir, engine_factory)
    try:
        result = {
            "generated": generate,
            "n_samples": cfg.n_samples,
            "engines": {n: e.info.backend for n, e in session.engines.items()},
            "datasets": [],
        }
        for ds in cfg.datasets:
            entry: dict[str, Any] = {"index": ds.index, "path": ds.path, "rows": [], "error": None}
            try:
                source = first_rows(ds, rows)
            except Exception as e:  # the data cannot be read: say so, go on with the next dataset
                entry["error"] = f"cannot read {ds.path}: {type(e).__name__}: {e}"
                source = []
            entry["source_rows"] = len(source)
            entry["rows"] = session.rows(ds, source)
            result["datasets"].append(entry)
        return result
    finally:
        session.close()


def cost_of_preview(cfg: PipelineConfig, result: dict, dataset_rows: list[int | None]) -> CostForecast | None:
    """The whole dataset's cost forecast from the previewed records (state/remaining.py cost_forecast,
    per dataset over its ``dataset_rows``): with answers, their usage at each processor's price;
    without, each request's estimate, as the budget holds it (its text's characters / 4 at the
    input price, its max_new_tokens at the output price). None when a dataset's size is unknown
    or nothing was previewed; a processor without a known price counts as unpriced."""
    from mirageflow.engines.wire import text_chars
    from mirageflow.state.remaining import cost_forecast
    from mirageflow.stats.pricing import processor_price
    from mirageflow.transport.rate_limit import estimate_tokens

    prices = {name: processor_price(p) for name, p in cfg.processors.items()}
    spent = total = 0.0
    units = unpriced = 0
    for ds, rows in zip(result["datasets"], dataset_rows):
        if rows is None or not ds["rows"]:
            return None
        ds_spent = 0.0
        for unit in ds["rows"]:
            for o in unit["outputs"]:
                if "messages" not in o or o["processor"] not in prices:
                    continue
                if "prompt_tokens" in o:
                    tokens = (o["prompt_tokens"], o["completion_tokens"])
                else:
                    chars = (
                        len(o["prompt"]) if o.get("prompt") is not None else sum(text_chars(m.get("content")) for m in o["messages"] or [])
                    )
                    limit = (o.get("sampling_params") or {}).get("max_new_tokens")
                    tokens = (estimate_tokens(chars, 0), limit if isinstance(limit, int) and limit > 0 else 0)
                price = prices[o["processor"]]
                if price is None:
                    unpriced += sum(tokens)
                else:
                    ds_spent += price.cost(*tokens)
        forecast = cost_forecast(ds_spent, len(ds["rows"]), rows * cfg.n_samples)
        spent, units, total = spent + ds_spent, units + len(ds["rows"]), total + (forecast.total_usd or 0.0)
    if not units:
        return None
    return CostForecast(spent, total, units, unpriced, done="previewed")


EXPORT_CHUNK = 256  # rows rendered at a time by export_prompts


def export_prompts(cfg: PipelineConfig, out: TextIO) -> dict:
    """``mmirage run --export-prompts``: every row's requests, as the engines would receive them, to a JSONL file.

    One line per row (per sample with n_samples > 1, with its "sample_index" and "seed")
    and LLM output: {"dataset", "source_index", "output", "processor", "prompt" (the chat
    template applied; null when an OpenAI-compatible server applies it), "messages",
    "sampling_params", "needs": the earlier outputs whose answers it needs (shown as
    placeholders)}; a row that fails (a missing key, a template error) is one line with its
    "error". Nothing is generated and no model is loaded (tokenizers only); the pipeline's
    state and outputs are not touched. Returns the counts (rows are source rows).
    """
    from mirageflow.prompts.templates import template_variables

    def variables_of(source: str) -> set[str]:
        return set(template_variables(source)) if source else set()

    produced = {o.name for o in cfg.outputs if o.kind != "filter"}
    needs = {
        o.name: sorted(variables_of(o.prompt or "") & produced | variables_of(o.system or "") & produced)
        for o in cfg.outputs if o.kind == "llm"
    }  # fmt: skip
    counts = {"rows": 0, "requests": 0, "row_errors": 0}
    session = _Session(cfg, generate=False, log_dir=None)
    try:
        for ds in cfg.datasets:
            source = iter_rows(ds)
            while chunk := list(itertools.islice(source, EXPORT_CHUNK)):
                counts["rows"] += len(chunk)
                failed = set()  # a row's error once, not once per sample
                for unit in session.rows(ds, chunk):
                    base = {"dataset": ds.index, "source_index": unit["source_index"]}
                    if "sample_index" in unit:
                        base["sample_index"] = unit["sample_index"]
                    for o in unit["outputs"]:
                        if o.get("kind", "llm") != "llm" or "messages" not in o:
                            continue
                        counts["requests"] += 1
                        line = {
                            **base, "output": o["name"], "processor": o["processor"], "prompt": o["prompt"],
                            "messages": o["messages"], "sampling_params": o["sampling_params"], "needs": needs.get(o["name"], []),
                        }  # fmt: skip
                        if "seed" in o:
                            line["seed"] = o["seed"]
                        out.write(json.dumps(line, ensure_ascii=False, default=str) + "\n")
                    if unit["error"] and unit["source_index"] not in failed:
                        failed.add(unit["source_index"])
                        counts["row_errors"] += 1
                        error = {"dataset": ds.index, "source_index": unit["source_index"], "error": unit["error"]}
                        out.write(json.dumps(error, ensure_ascii=False, default=str) + "\n")
        return counts
    finally:
        session.close()


def _model_step(cfg: PipelineConfig, output, engines: dict):
    if output.kind == "image_gen":  # its prompt is shown; no generator is loaded
        return ShownImage(output, cfg.image_processors[output.processor], None, None, [v.name for v in cfg.inputs])
    return LLMStep(output, cfg.processors[output.processor], engines[output.processor])


def _placeholder(step, cfg):
    """The step as a preview without generation runs it (placeholders, Python steps not run;
    an image output never generates)."""
    if isinstance(step, ShownImage):
        return step
    if isinstance(step, python_steps.FilterStep):
        return SkippedFilter(step.output)
    if isinstance(step, python_steps.CustomStep):
        return SkippedCustom(step.output, step.pool)
    return PlaceholderStep(step.output, step.processor, step.engine)


# --------------------------------------------------------------------------- text


def _indent(text: str, prefix: str = "    | ") -> str:
    return "\n".join(prefix + line for line in str(text).split("\n"))


def _dump(value) -> str:
    return json.dumps(value, ensure_ascii=False, indent=2, default=str)


def print_preview(result: dict, out: TextIO = sys.stdout) -> None:
    w = out.write
    n = result.get("n_samples", 1)
    for ds in result["datasets"]:
        rows = ds.get("source_rows", len(ds["rows"]))
        per = f", {n} samples per row: {len(ds['rows'])} record(s)" if n > 1 else ""
        w(f"=== dataset {ds['index']}: {ds['path']} (first {rows} row(s){per}) ===\n")
        if ds.get("error"):
            w(f"ERROR: {ds['error']}\n\n")
        for row in ds["rows"]:
            sample = f" sample {row['sample_index']} of {n}" if "sample_index" in row else ""
            w(f"\n--- row {row['source_index']}{sample} ---\n")
            if row["variables"] is not None:
                w("variables:\n" + _indent(_dump(row["variables"]), "    ") + "\n")
            for o in row["outputs"]:
                kind = "JSON output" if o["json"] else "output"
                if o.get("kind") == "image_gen":
                    w(
                        f"image output '{o['name']}' (processor {o['processor']}): prompt (a preview generates no image):\n"
                        + _indent(o["prompt"])
                        + "\n"
                    )
                    continue
                if o.get("kind", "llm") != "llm":
                    shown = _dump(o["value"]) if "value" in o else "(not run without --generate)"
                    w(f"{o['kind']} step '{o['name']}': {shown}\n")
                    continue
                seed = f", seed {o['seed']}" if "seed" in o else ""
                if "messages" not in o:  # the row failed before its request was made (its error follows)
                    w(f"{kind} '{o['name']}' (processor {o['processor']}): no request (the row failed before it)\n")
                elif o.get("prompt") is not None:
                    w(f"{kind} '{o['name']}' (processor {o['processor']}{seed}): prompt as the engine receives it:\n")
                    w(_indent(o["prompt"]) + "\n")
                else:
                    w(f"{kind} '{o['name']}' (processor {o['processor']}{seed}): chat messages (the server applies its chat template):\n")
                    w(_indent(_dump(o["messages"])) + "\n")
                if "answer" in o:
                    w(f"  answer ({o['completion_tokens']} tokens, finish_reason {o['finish_reason']}):\n" + _indent(o["answer"]) + "\n")
                if "value" in o and o["json"]:
                    w("  parsed JSON:\n" + _indent(_dump(o["value"]), "    ") + "\n")
            if row.get("filtered"):
                w("FILTERED: a filter step dropped this row (no record)\n")
            if row["error"]:
                e = row["error"]
                w(f"ROW ERROR ({e['stage']}, {e['error']}): {e['message']}\n")
                if e.get("raw") is not None:
                    w("  model text:\n" + _indent(e["raw"]) + "\n")
            if row["record"] is not None:
                w("record (as a shard writes it):\n" + _indent(_dump(row["record"]), "    ") + "\n")
        w("\n")
    if not result["generated"]:
        w("(no model was loaded; run with --generate to see the answers)\n")
