"""Merge a dataset's shard outputs into <output_dir>/merged/, in source order (with
n_samples > 1: by source_index, then sample_index: x x x y y y)."""

from __future__ import annotations

import json
from pathlib import Path

from mirageflow.config.types import DatasetConfig, PipelineConfig
from mirageflow.data.writers import (
    ColumnNeedsJson,
    PartUnreadable,
    conform,
    plan_schema,
    read_part_table,
    write_merged,
)
from mirageflow.errors import MirageflowError
from mirageflow.state.layout import StateLayout, merged_dir, shard_output_dir
from mirageflow.state.records import check_status, read
from mirageflow.state.shards import is_done, job_fingerprint, stale_reason


class MergeRefused(MirageflowError, RuntimeError):
    pass


def _damaged(e: Exception, shard_id: int, cfg) -> MergeRefused:
    """``cfg``: the pipeline's config, ``_NoState`` or None (merge-dir, no pipeline state)."""
    if cfg is None or cfg.state_dir is None:  # merge_directory: no pipeline state
        return MergeRefused(f"{e}. The outputs of shard {shard_id} are damaged")
    return MergeRefused(
        f"{e}. The outputs of shard {shard_id} are damaged: delete {StateLayout(cfg.state_dir).shard_dir(shard_id)} (its checkpoint) "
        f"and the shard's output directory, rerun the workflow so shard {shard_id} runs again, then merge"
    )


def _parquet_plan(parts: dict[int, list[Path]], cfg: PipelineConfig | _NoState):
    """Every non-empty part's schema (from its footer), to plan one merged schema."""
    import pyarrow.parquet as pq

    schemas = []
    for shard_id, paths in parts.items():
        for p in paths:
            try:
                meta = pq.read_metadata(p)
                schema = meta.schema.to_arrow_schema()
            except Exception as e:
                raise _damaged(
                    PartUnreadable(f"{p}: cannot read this Parquet part file ({type(e).__name__}: {e})"), shard_id, cfg
                ) from None
            if meta.num_rows:
                schemas.append(schema)
    return schemas


def _check_order(where, idx: list[int], last: int) -> None:
    if idx and (idx[0] <= last or any(b <= a for a, b in zip(idx, idx[1:]))):
        raise MergeRefused(f"{where}: a source_index appears twice, or in the wrong shard; the shard outputs were mixed up")


def _check_count(shard_id: int, found: int, expected: dict[int, int] | None, cfg) -> None:
    """A shard's parts must hold the records its status.json counted (nothing lost or added;
    ``expected`` None: no status.json to compare with, merge_directory)."""
    if expected is not None and found != expected[shard_id]:
        raise _damaged(
            PartUnreadable(f"shard {shard_id}'s parts hold {found} records, its status.json counts {expected[shard_id]}"), shard_id, cfg
        )


def _parquet_tables(parts: dict[int, list[Path]], cfg: PipelineConfig | _NoState, schema, out_dir: Path, expected: dict[int, int] | None):
    import pyarrow as pa

    last = -1
    for shard_id, paths in parts.items():
        tables = []
        for p in paths:
            try:
                table = read_part_table(p)
            except PartUnreadable as e:
                raise _damaged(e, shard_id, cfg) from None
            if table.num_rows:
                tables.append(conform(table, schema))
        _check_count(shard_id, sum(t.num_rows for t in tables), expected, cfg)
        if not tables:
            continue
        # Parts hold rows in completion order; a shard's rows are sorted here.
        n = cfg.n_samples
        if n == 1:
            table = pa.concat_tables(tables).sort_by("source_index")
            idx = table.column("source_index").to_pylist()
        else:
            table = pa.concat_tables(tables).sort_by([("source_index", "ascending"), ("sample_index", "ascending")])
            idx = [i * n + k for i, k in zip(table.column("source_index").to_pylist(), table.column("sample_index").to_pylist())]
        _check_order(shard_output_dir(out_dir, shard_id), idx, last)
        last = idx[-1]
        yield table


_TAIL = b'"source_index": '


def _source_index(line: bytes, where: str) -> int:
    """A record line's source_index. Fast path: the last member, as RecordRenderer writes it
    (``, "source_index": 12}``); otherwise the line is parsed (ints kept exact)."""
    body = line.rstrip()
    cut = body.rfind(_TAIL)
    if cut > 0 and body.endswith(b"}") and body[cut - 1 : cut] in (b" ", b"{"):
        digits = body[cut + len(_TAIL) : -1]
        if digits.isdigit():
            return int(digits)
    try:
        value = json.loads(line)
        index = value["source_index"]
    except (ValueError, TypeError, KeyError) as e:
        raise PartUnreadable(f"{where}: not a JSON record with a source_index ({type(e).__name__}: {e})") from None
    if type(index) is not int:
        raise PartUnreadable(f"{where}: source_index is {index!r}, not an integer")
    return index


def _sample_unit(n: int):
    """A record line's unit, source_index * n + sample_index (n_samples > 1)."""

    def key(line: bytes, where: str) -> int:
        try:
            value = json.loads(line)
            index, sample = value["source_index"], value["sample_index"]
        except (ValueError, TypeError, KeyError) as e:
            raise PartUnreadable(f"{where}: not a JSON record with a source_index and a sample_index ({type(e).__name__}: {e})") from None
        if type(index) is not int or type(sample) is not int or not 0 <= sample < n:
            raise PartUnreadable(
                f"{where}: source_index {index!r}, sample_index {sample!r}: not integers, or a sample beyond n_samples {n}"
            )
        return index * n + sample

    return key


def _jsonl_line_lists(parts: dict[int, list[Path]], cfg: PipelineConfig | _NoState, out_dir: Path, expected: dict[int, int] | None):
    """Each shard's record lines, byte for byte as the parts hold them, in source order."""
    last = -1
    n = cfg.n_samples
    key = _source_index if n == 1 else _sample_unit(n)
    for shard_id, paths in parts.items():
        keyed = []
        for p in paths:
            try:
                with open(p, "rb") as f:
                    for lineno, line in enumerate(f, start=1):
                        if not line.strip():
                            continue
                        if not line.endswith(b"\n"):
                            line += b"\n"
                        keyed.append((key(line, f"{p}:{lineno}"), line))
            except PartUnreadable as e:
                raise _damaged(e, shard_id, cfg) from None
            except OSError as e:
                raise _damaged(PartUnreadable(f"{p}: cannot read this JSONL part file ({e})"), shard_id, cfg) from None
        _check_count(shard_id, len(keyed), expected, cfg)
        if not keyed:
            continue
        keyed.sort(key=lambda kv: kv[0])  # stable; parts are sorted runs, so this is a merge
        idx = [k for k, _ in keyed]
        _check_order(shard_output_dir(out_dir, shard_id), idx, last)
        last = idx[-1]
        yield [line for _, line in keyed]


def merge_dataset(cfg: PipelineConfig, ds: DatasetConfig, out: Path | None = None, allow_missing: bool = False) -> dict:
    """Write merged/ for dataset ``ds``; refuse (nothing written) when any shard is not done
    (the state contract's ``is_done``: a successful status.json of the current records fingerprint).

    ``out``: another folder than ``<output_dir>/merged/``; ``allow_missing``: merge the done
    shards and leave out the others (a partial dataset: ``mmirage publish --allow-partial``),
    named in the manifest's ``shards_left_out``."""
    missing, stale, damaged, expected, parts = [], [], [], {}, {}
    out_dir = Path(ds.output_dir)
    fmt = ds.output_format
    paths, fingerprint = StateLayout(cfg.state_dir), job_fingerprint(cfg)
    for shard_id in range(cfg.num_shards):
        status_path = paths.status(shard_id)
        status, why = read(status_path, lambda s: check_status(s, shard_id))
        if why:
            damaged.append(f"{status_path} ({why})")
            continue
        if not is_done(status, cfg.num_shards, fingerprint):
            (stale if status is not None and stale_reason(status, fingerprint) else missing).append(shard_id)
            continue
        try:  # the parts its checkpoint listed, and how many records they hold (the accounting)
            entry = status["datasets"][ds.index]
            expected[shard_id] = int(entry["rows_processed"])
            parts[shard_id] = [shard_output_dir(out_dir, shard_id) / name for name in entry["parts"]]
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            damaged.append(f"{status_path} ({type(e).__name__}: {e})")
    if damaged or ((missing or stale) and not allow_missing):
        raise MergeRefused(
            f"cannot merge {ds.path}: "
            + (f"shard(s) {missing} of {cfg.num_shards} are not complete (no successful "
               f"{cfg.state_dir}/shard_<id>/status.json); run the workflow until every shard succeeds. " if missing else "")
            + (f"shard(s) {stale} hold results of an earlier config (their status.json has another records "
               "fingerprint); run the workflow to rerun them. " if stale else "")
            + (f"damaged status files: {'; '.join(damaged)}; delete them and rerun those shards" if damaged else "")
        )  # fmt: skip

    out = merged_dir(out_dir) if out is None else Path(out)
    left_out = {"shards_left_out": sorted(missing + stale)} if allow_missing else {}
    if fmt != "parquet":
        rows = write_merged(_jsonl_line_lists(parts, cfg, out_dir, expected), out, fmt)
        return {"dataset": ds.path, "merged_dir": str(out), "rows": rows, "format": fmt, **left_out}

    # One schema for every shard's parts: each part inferred its own types (a column that
    # is null in all of a part's rows has type null there; int in one, float or str in
    # another). A column whose types cannot be unified without changing a value is JSON
    # text in merged/ (writers: the storage rule); a cast that would change a value is
    # only found while writing, so the merge then starts again with that column as JSON.
    schemas = _parquet_plan(parts, cfg)
    as_json: set[str] = set()
    while True:
        schema = plan_schema(schemas, as_json)
        try:
            rows = write_merged(_parquet_tables(parts, cfg, schema, out_dir, expected), out, fmt)
            break
        except ColumnNeedsJson as e:
            as_json.add(e.name)
    return {"dataset": ds.path, "merged_dir": str(out), "rows": rows, "format": fmt, **left_out}


# --------------------------------------------------------------------------- merge-dir (no config)


class _NoState:
    """What the merge needs of a config when there is none (``mmirage merge-dir``)."""

    state_dir = None

    def __init__(self, n_samples: int):
        self.n_samples = n_samples


def _shard_dirs(path: Path) -> dict[int, Path]:
    found = {}
    for p in path.glob("shard_*"):
        suffix = p.name[len("shard_") :]
        if p.is_dir() and suffix.isdigit():
            found[int(suffix)] = p
    return dict(sorted(found.items()))


def _n_samples(parts: dict[int, list[Path]], fmt: str) -> int:
    """1 + the largest sample_index of the records (1 without one): the key of a record is source_index * n + sample."""
    import pyarrow.parquet as pq

    top = -1
    for shard_id, paths in parts.items():
        for p in paths:
            if fmt == "parquet":
                try:
                    if "sample_index" not in pq.read_schema(p).names:
                        return 1
                    column = pq.read_table(p, columns=["sample_index"]).column(0).to_pylist()
                except Exception as e:  # noqa: BLE001 - whatever pyarrow raises, the file is named
                    raise _damaged(
                        PartUnreadable(f"{p}: cannot read this Parquet part file ({type(e).__name__}: {e})"), shard_id, None
                    ) from None
                top = max([top, *[v for v in column if isinstance(v, int)]])
            else:
                with open(p, "rb") as f:
                    for number, line in enumerate(f, 1):
                        if line.strip():
                            try:
                                sample = json.loads(line).get("sample_index")
                                if sample is None:
                                    return 1
                                top = max(top, int(sample))
                            except (ValueError, TypeError, AttributeError) as e:
                                raise _damaged(
                                    PartUnreadable(f"{p}:{number}: not a JSON record ({type(e).__name__}: {e})"), shard_id, None
                                ) from None
    return top + 1 if top >= 0 else 1


def merge_directory(input_dir: str | Path, output_dir: str | Path) -> list[dict]:
    """``mmirage merge-dir``: merge the shard_<id>/ outputs found under ``input_dir`` into ``output_dir``.

    ``input_dir`` holds shard_* folders (one dataset, merged into ``output_dir``) or
    folders that do (each merged into ``output_dir/<its name>``), as MMIRAGE reads it.
    Records are ordered by source_index (then sample_index) and a record found twice is
    refused, as in the pipeline's merge; but without the pipeline's state the shards'
    completeness cannot be checked (``mmirage merge --config C`` does). An output folder
    that exists and is not empty is refused: nothing is replaced.
    """
    src, dest = Path(input_dir).expanduser().resolve(), Path(output_dir).expanduser().resolve()
    if not src.is_dir():
        raise MergeRefused(f"--input-dir {input_dir}: not a directory")
    if dest == src or src in dest.parents:
        raise MergeRefused(f"--output-dir {output_dir} is inside --input-dir {input_dir}: it would become input")

    def has_parts(d: Path) -> bool:  # not a state_dir, whose shard_* folders hold no part files
        return any(next(s.glob("part-*.*"), None) for s in _shard_dirs(d).values())

    if _shard_dirs(src):
        datasets = [(src, dest)]
    else:
        datasets = [(d, dest / d.name) for d in sorted(src.iterdir()) if d.is_dir() and not d.name.startswith(".") and has_parts(d)]
    if not datasets:
        raise MergeRefused(f"no shard_* folders in {input_dir} nor in its subfolders")
    for _, out in datasets:
        if out.exists() and any(out.iterdir()):
            raise MergeRefused(f"{out} exists and is not empty: choose another --output-dir, or delete it")
    reports = []
    for dataset_dir, out in datasets:
        parts = {i: sorted(d.glob("part-*.*")) for i, d in _shard_dirs(dataset_dir).items()}
        formats = {p.suffix.lstrip(".") for paths in parts.values() for p in paths}
        if len(formats) != 1 or not formats <= {"parquet", "jsonl"}:
            raise MergeRefused(
                f"{dataset_dir}: the shards hold {'no part files' if not formats else 'part files of ' + ', '.join(sorted(formats))}; "
                "expected part-*.parquet or part-*.jsonl files, one format"
            )
        fmt = formats.pop()
        cfg = _NoState(_n_samples(parts, fmt))
        if fmt == "jsonl":
            rows = write_merged(_jsonl_line_lists(parts, cfg, dataset_dir, None), out, fmt)
        else:
            schemas = _parquet_plan(parts, cfg)
            as_json: set[str] = set()
            while True:
                try:
                    rows = write_merged(_parquet_tables(parts, cfg, plan_schema(schemas, as_json), dataset_dir, None), out, fmt)
                    break
                except ColumnNeedsJson as e:
                    as_json.add(e.name)
        reports.append({"input_dir": str(dataset_dir), "output_dir": str(out), "shards": len(parts), "rows": rows, "format": fmt})
    return reports
