"""``mmirage preview``: try a pipeline's prompts on the first rows of each dataset.

For the first ``rows`` rows of every dataset it shows what the shard runner would do with
them, through the runner's own pieces (``prompts.Extractor``, ``shard.steps.OutputStep``,
``prompts.RecordRenderer``): the extracted variables, each prompt exactly as the engine
receives it (the model's chat template applied through the engine's ``chat_prompt``) and
the rendered record. Without ``--generate`` no model is loaded: a transformers, sglang or
sglang_server processor loads only its tokenizer (for the chat template); an openai one
sends chat messages and the server applies its own template, so the messages are shown.
An output's answer is then a placeholder, so later prompts and the record show where it
goes.

With ``generate=True`` the configured engine is loaded and the rows are generated; the
answers, the parsed JSON and each row's error are shown. Engine logs go to a temporary
directory; the pipeline's state_dir and output_dirs are never read or written.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

from mirageflow.config.types import DatasetConfig, PipelineConfig, ProcessorConfig
from mirageflow.engines import registry
from mirageflow.engines.base import Engine
from mirageflow.engines.wire import EngineInfo
from mirageflow.prompts import python_steps
from mirageflow.prompts.images import RowImages
from mirageflow.errors import RowError
from mirageflow.prompts.templates import Extractor, RecordRenderer
from mirageflow.shard.steps import OutputStep

DEFAULT_ROWS = 3


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
    OpenAI-compatible server, which templates the messages itself)."""

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

    async def generate_one(self, request):  # pragma: no cover - never called
        raise RuntimeError("a template-only engine does not generate")


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
    """The dataset's first ``n`` rows (default: all), read as they are consumed."""
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


async def _preview_row(row, extract, steps: list[OutputStep], render, generate: bool, images=None) -> dict:
    """``images``: variables -> the row's loaded image inputs (mirageflow.prompts.images), when the config has any."""
    out: dict[str, Any] = {"source_index": row.index, "variables": None, "outputs": [], "record": None, "error": None}
    try:
        if isinstance(row.value, RowError):
            raise row.value
        variables = extract(row.value)
        out["variables"] = _plain(variables)
        row_images = images(variables) if images else None
        for step in steps:
            entry: dict[str, Any] = {"name": step.output.name, "processor": step.output.processor, "json": step.output.is_json}
            out["outputs"].append(entry)
            if step.engine is None:  # a filter or Python step: run only with generate (earlier values are placeholders)
                if not generate:
                    if step.output.kind == "custom":
                        variables[step.output.name] = NotGenerated(step.output.name)
                    continue
                kept = await step.run(variables)
                entry["value"] = _plain(variables[step.output.name]) if step.output.kind == "custom" else kept
                if not kept:
                    out["filtered"] = True  # the runner writes no record for this row
                    return out
                continue
            request = step.request(row.index, variables, images=row_images)
            entry["messages"] = request.messages
            if request.images:  # in placeholder order
                entry["images"] = [{"source": im.source, "width": im.width, "height": im.height, "sha256": im.sha256} for im in request.images]
            entry["prompt"] = request.prompt  # None: the server applies its chat template to the messages
            entry["sampling_params"] = request.sampling_params
            if not generate:
                variables[step.output.name] = NotGenerated(step.output.name)
                continue
            completion = await step.engine.generate_one(request)
            entry.update(
                answer=completion.text, finish_reason=completion.finish_reason,
                prompt_tokens=completion.prompt_tokens, completion_tokens=completion.completion_tokens,
            )  # fmt: skip
            step.assign(variables, completion)
            entry["value"] = _plain(variables[step.output.name])
        out["record"] = _plain(render(row.index, row.value, variables))
    except RowError as e:
        out["error"] = _error(e)
    except Exception as e:  # ours, not the row's: the row shows it, the other rows are previewed
        out["error"] = {"stage": "row", "error": "internal_error", "message": f"{type(e).__name__}: {e}"}
    return out


class _Session:
    """What a preview needs for its rows: the extractor, images, renderer and steps (engines
    loaded with ``generate``, else their chat templates only); close() stops them."""

    def __init__(self, cfg: PipelineConfig, generate: bool, log_dir: str | Path | None):
        self.cfg, self.generate = cfg, generate
        self.extract = Extractor(cfg.inputs)
        self.row_images = RowImages.from_config(cfg)
        self.render = RecordRenderer(cfg.output_schema, cfg.remove_columns, [o.name for o in cfg.outputs if o.kind != "filter"])
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
            for name in dict.fromkeys(o.processor for o in cfg.outputs if o.kind == "llm"):
                processor = cfg.processors[name]
                engine = registry.create_engine(processor, cfg.batch_size, log_dir=Path(log_dir) / name) if generate else TemplateOnlyEngine(processor)
                self.engines[name] = engine
                engine.load()
            self.steps = [
                python_steps.make_step(o, lambda o: OutputStep(o, cfg.processors[o.processor], self.engines[o.processor]), self.pools)
                for o in cfg.outputs
            ]
        except BaseException:
            self.close()
            raise

    def rows(self, ds, source: list) -> list[dict]:
        async def run():
            load = (lambda v, i=ds.index: self.row_images(v, i)) if self.row_images else None
            return await asyncio.gather(*(_preview_row(r, self.extract, self.steps, self.render, self.generate, load) for r in source))

        return list(asyncio.run(run())) if source else []

    def close(self) -> None:
        python_steps.close_pools(self.pools)
        for engine in self.engines.values():
            try:
                engine.close()
            except Exception:
                pass
        if self._scratch is not None:
            self._scratch.cleanup()


def preview(cfg: PipelineConfig, rows: int = DEFAULT_ROWS, generate: bool = False, log_dir: str | Path | None = None) -> dict:
    """{"datasets": [{index, path, rows: [...]}], "generated": bool, "engines": {...}}: what the runner would do
    with the first ``rows`` rows of each dataset (and, with ``generate``, what the engine answered)."""
    session = _Session(cfg, generate, log_dir)
    try:
        result = {"generated": generate, "engines": {n: e.info.backend for n, e in session.engines.items()}, "datasets": []}
        for ds in cfg.datasets:
            entry: dict[str, Any] = {"index": ds.index, "path": ds.path, "rows": [], "error": None}
            try:
                source = first_rows(ds, rows)
            except Exception as e:  # the data cannot be read: say so, go on with the next dataset
                entry["error"] = f"cannot read {ds.path}: {type(e).__name__}: {e}"
                source = []
            entry["rows"] = session.rows(ds, source)
            result["datasets"].append(entry)
        return result
    finally:
        session.close()


EXPORT_CHUNK = 256  # rows rendered at a time by export_prompts


def export_prompts(cfg: PipelineConfig, out: TextIO) -> dict:
    """``mmirage run --export-prompts``: every row's requests, as the engines would receive them, to a JSONL file.

    One line per row and LLM output: {"dataset", "source_index", "output", "processor",
    "prompt" (the chat template applied; null when an OpenAI-compatible server applies
    it), "messages", "sampling_params", "needs": the earlier outputs whose answers it
    needs (shown as placeholders)}; a row that fails (a missing key, a template error) is a
    line with its "error". Nothing is generated and no model is loaded (tokenizers only);
    the pipeline's state and outputs are not touched. Returns the counts.
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
                for row in session.rows(ds, chunk):
                    counts["rows"] += 1
                    base = {"dataset": ds.index, "source_index": row["source_index"]}
                    for o in row["outputs"]:
                        if o["processor"] in ("filter", "custom") or "messages" not in o:
                            continue
                        counts["requests"] += 1
                        out.write(json.dumps({
                            **base, "output": o["name"], "processor": o["processor"], "prompt": o["prompt"],
                            "messages": o["messages"], "sampling_params": o["sampling_params"], "needs": needs.get(o["name"], []),
                        }, ensure_ascii=False, default=str) + "\n")  # fmt: skip
                    if row["error"]:
                        counts["row_errors"] += 1
                        out.write(json.dumps({**base, "error": row["error"]}, ensure_ascii=False, default=str) + "\n")
        return counts
    finally:
        session.close()


# --------------------------------------------------------------------------- text


def _indent(text: str, prefix: str = "    | ") -> str:
    return "\n".join(prefix + line for line in str(text).split("\n"))


def _dump(value) -> str:
    return json.dumps(value, ensure_ascii=False, indent=2, default=str)


def print_preview(result: dict, out: TextIO = sys.stdout) -> None:
    w = out.write
    for ds in result["datasets"]:
        w(f"=== dataset {ds['index']}: {ds['path']} (first {len(ds['rows'])} row(s)) ===\n")
        if ds.get("error"):
            w(f"ERROR: {ds['error']}\n\n")
        for row in ds["rows"]:
            w(f"\n--- row {row['source_index']} ---\n")
            if row["variables"] is not None:
                w("variables:\n" + _indent(_dump(row["variables"]), "    ") + "\n")
            for o in row["outputs"]:
                kind = "JSON output" if o["json"] else "output"
                if o["processor"] in ("filter", "custom"):
                    shown = _dump(o["value"]) if "value" in o else "(not run without --generate)"
                    w(f"{o['processor']} step '{o['name']}': {shown}\n")
                    continue
                if "messages" not in o:  # the row failed before its request was made (its error follows)
                    w(f"{kind} '{o['name']}' (processor {o['processor']}): no request (the row failed before it)\n")
                elif o.get("prompt") is not None:
                    w(f"{kind} '{o['name']}' (processor {o['processor']}): prompt as the engine receives it:\n")
                    w(_indent(o["prompt"]) + "\n")
                else:
                    w(f"{kind} '{o['name']}' (processor {o['processor']}): chat messages (the server applies its chat template):\n")
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
                w("record:\n" + _indent(_dump(row["record"]), "    ") + "\n")
        w("\n")
    if not result["generated"]:
        w("(no model was loaded; run with --generate to see the answers)\n")
