"""Exact and near-duplicate removal after merge (MMIRAGE's ``deduplication_params``).

Reads a dataset's ``<output_dir>/merged/`` and writes ``<output_dir>/deduplicated/`` in the
same format (JSONL: each kept line byte for byte; Parquet: each merged part filtered, so its
schema and field metadata, ``mirageflow.encoding: json`` included, stay as they were), in
merged (source) order, replaced atomically as merged/ is. The first occurrence of a text is
kept; the result is deterministic (fixed MinHash seed, rows taken in order).

- The text of a record is its ``text_field`` (a top-level field). A record whose field is
  missing, null or not a string (a number, a list) is kept and counted as
  ``rows_without_text``; it takes no part in either pass.
- Texts are compared normalised as MMIRAGE does: lower case, runs of whitespace as one
  space, no leading or trailing whitespace. ``exact`` removes a record whose normalised
  text equals an earlier kept record's (BLAKE2b-128 digest).
- ``fuzzy`` then removes near duplicates with datasketch: a MinHash (``num_perm``
  permutations, seed 1) of the normalised text's character shingles of ``shingle_size``
  characters (a text shorter than that is one shingle; each shingle hashed by zlib's
  CRC-32: datasketch's default SHA-1 made the pass ~1.7x slower for the same recall),
  looked up in a MinHashLSH index of the kept records at ``threshold``, banded to favour
  recall (``LSH_WEIGHTS``). LSH returns candidates, some below the threshold: a record is
  removed only when a candidate's estimated Jaccard similarity (the share of equal
  MinHash values) reaches ``threshold``; it then names the earliest such record.
  ``threshold: 1`` means equal MinHash signatures (a dictionary; LSH cannot band it). A
  threshold close to 1 with few permutations leaves datasketch fewer than 2 bands: the
  driver refuses it (``dedup_problems``), naming the key.

Nothing is lost silently: ``<state_dir>/dedup/dataset_<ds>.removed.jsonl`` lists every
removed record (``row``: its position in merged order, its ``source_index``, ``kind``
exact or near, ``duplicate_of_row`` and ``duplicate_of``: the kept record's position and
source_index, with n_samples the two ``sample_index`` values, and for ``near`` the
estimated ``similarity``), and the rule checks rows_in = rows_out + removed.
"""

from __future__ import annotations

import hashlib
import json
import time
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator

from mirageflow.config.types import DatasetConfig, DedupParams, OutputVar, PipelineConfig
from mirageflow.data.writers import PartUnreadable, is_json_field, jsonl_line, write_merged
from mirageflow.files import atomic_write_bytes, atomic_write_json, digest_of
from mirageflow.errors import MirageflowError
from mirageflow.state.layout import StateLayout, merged_dir

DEDUP_SUBDIR = "deduplicated"
MINHASH_SEED = 1  # datasketch's default; fixed so a rerun removes the same records
# LSH banding weighted against missed pairs (datasketch's weights: false positives, false
# negatives): every candidate is verified by its MinHash estimate, so an extra candidate
# costs a comparison while a missed one is a duplicate kept. At threshold 0.85 and 128
# permutations: 11 bands of 11 instead of 8 of 16 (scripts/bench/dedup.py).
LSH_WEIGHTS = (0.1, 0.9)


class DedupError(MirageflowError, RuntimeError):
    """The merged output cannot be deduplicated as it is; the message names the file."""


def normalize(text: str) -> str:
    """MMIRAGE's normalisation: lower case, whitespace runs as one space, stripped."""
    return " ".join(text.lower().split())


def shingles(text: str, k: int) -> set[bytes]:
    """Character k-shingles of an already normalised text (UTF-8); one shingle when shorter."""
    if len(text) < k:
        return {text.encode("utf-8")}
    return {text[i : i + k].encode("utf-8") for i in range(len(text) - k + 1)}


class Deduplicator:
    """Decides, record by record in order, whether a text duplicates an earlier kept one."""

    def __init__(self, params: DedupParams):
        from datasketch import MinHash, MinHashLSH

        self.params = params
        # a record is named by an ident tuple whose first item is its position in merged order
        self._seen: dict[bytes, tuple] = {}  # exact: digest -> ident of the kept record
        self._MinHash = MinHash
        # Generating the permutations is most of a MinHash's construction cost: once here.
        base = MinHash(num_perm=params.num_perm, seed=MINHASH_SEED)
        self._perms, self._scheme = base.permutations, base.scheme
        # threshold 1 (every MinHash value equal) is an exact match of signatures; datasketch's
        # banding cannot express it (fewer than 2 bands)
        fuzzy_lsh = params.fuzzy and params.threshold < 1
        try:
            self._lsh = MinHashLSH(threshold=params.threshold, num_perm=params.num_perm, weights=LSH_WEIGHTS) if fuzzy_lsh else None
        except ValueError as e:  # the driver refuses this config (dedup_problems); a job run by hand may not have
            raise DedupError(f"deduplication_params.threshold: {params.threshold} with num_perm {params.num_perm}: {e}") from None
        self._signatures: dict[bytes, tuple] = {}  # threshold 1: signature -> ident
        self._kept: dict[int, Any] = {}  # fuzzy: LSH key -> (ident, hash values)
        self._next_key = 0

    def check(self, ident: Any, text: str) -> tuple[str, Any, float | None] | None:
        """None to keep the record (it is then remembered under ``ident``), else (kind, the
        kept record's ident, estimated similarity for near duplicates). Idents are compared
        (the earliest kept record wins), so they start with the record's position."""
        norm = normalize(text)
        digest = None
        if self.params.exact:
            digest = hashlib.blake2b(norm.encode("utf-8"), digest_size=16).digest()
            first = self._seen.get(digest)
            if first is not None:
                return "exact", first, None
        if self.params.fuzzy:
            m = self._MinHash(
                num_perm=self.params.num_perm, seed=MINHASH_SEED, permutations=self._perms, scheme=self._scheme, hashfunc=zlib.crc32
            )
            m.update_batch(list(shingles(norm, self.params.shingle_size)))
            if self._lsh is None:
                signature = m.hashvalues.tobytes()
                first = self._signatures.get(signature)
                if first is not None:
                    return "near", first, 1.0
                self._signatures[signature] = ident
                if digest is not None:
                    self._seen[digest] = ident
                return None
            best = None
            for key in self._lsh.query(m):
                kept_index, values = self._kept[key]
                similarity = float((values == m.hashvalues).mean())
                if similarity >= self.params.threshold and (best is None or kept_index < best[0]):
                    best = (kept_index, similarity)
            if best is not None:
                return "near", best[0], round(best[1], 4)
            key, self._next_key = self._next_key, self._next_key + 1
            self._lsh.insert(key, m)
            self._kept[key] = (ident, m.hashvalues.copy())
        if digest is not None:
            self._seen[digest] = ident
        return None


class _Counter:
    def __init__(self):
        self.rows_in = self.rows_without_text = self.exact = self.near = 0
        self.removed: list[bytes] = []

    def decide(self, dedup: Deduplicator, ordinal: int, record: Any, field: str) -> bool:
        """Whether to keep the record (counting it either way)."""
        self.rows_in += 1
        record = record if isinstance(record, dict) else {}
        text = record.get(field)
        if not isinstance(text, str):
            self.rows_without_text += 1
            return True
        # position in merged order; source_index and (n_samples) sample_index as the record has them
        ident = (ordinal, record.get("source_index"), record.get("sample_index"))
        found = dedup.check(ident, text)
        if found is None:
            return True
        kind, first, similarity = found
        if kind == "exact":
            self.exact += 1
        else:
            self.near += 1
        entry = {"row": ordinal, "source_index": ident[1], "kind": kind, "duplicate_of_row": first[0], "duplicate_of": first[1]}
        if ident[2] is not None or first[2] is not None:
            entry["sample_index"], entry["duplicate_of_sample"] = ident[2], first[2]
        if similarity is not None:
            entry["similarity"] = similarity
        self.removed.append(jsonl_line(entry))
        return False


def _merged_parts(merged: Path, fmt: str) -> list[Path]:
    if not merged.is_dir():
        raise DedupError(f"{merged}: no merged output to deduplicate (the merge rule writes it)")
    return sorted(merged.glob(f"part-*.{fmt}"))


def _jsonl_kept(parts: list[Path], dedup: Deduplicator, counter: _Counter, field: str) -> Iterator[list[bytes]]:
    for path in parts:
        kept = []
        try:
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as e:
                        raise DedupError(f"{path}:{lineno}: not a JSON record ({e})") from None
                    if counter.decide(dedup, counter.rows_in, record, field):
                        kept.append(line if line.endswith(b"\n") else line + b"\n")
        except OSError as e:
            raise DedupError(f"{path}: cannot read this merged part ({e})") from None
        yield kept


def _parquet_kept(parts: list[Path], dedup: Deduplicator, counter: _Counter, field: str) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in parts:
        try:
            table = pq.read_table(path)
        except Exception as e:
            raise DedupError(f"{path}: cannot read this merged Parquet part ({type(e).__name__}: {e})") from e
        n = table.num_rows
        columns = {}  # only the columns read: the text, and what names a record
        for name in (field, "source_index", "sample_index"):
            if name in table.column_names:
                values = table.column(name).to_pylist()
                if is_json_field(table.schema.field(name)):  # JSON text: the values are what it decodes to
                    values = [json.loads(v) if v is not None else None for v in values]
                columns[name] = values
        keep = []
        for i in range(n):
            record = {name: values[i] for name, values in columns.items()}
            keep.append(counter.decide(dedup, counter.rows_in, record, field))
        yield table.filter(pa.array(keep, type=pa.bool_()))


def dedup_dataset(cfg: PipelineConfig, ds: DatasetConfig, params: DedupParams, counts_path: str | Path, removed_path: str | Path) -> dict:
    """Write ``<output_dir>/deduplicated/``, the removed list and the counts; return the counts."""
    started = time.monotonic()
    fmt = ds.output_format
    merged = merged_dir(ds.output_dir)
    manifest_path = StateLayout(cfg.state_dir).merge_manifest(ds.index)
    try:
        merged_rows = json.loads(manifest_path.read_text(encoding="utf-8"))["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DedupError(f"{manifest_path}: cannot read the merge manifest ({type(e).__name__}: {e}); rerun the merge rule") from None
    parts = _merged_parts(merged, fmt)
    dedup, counter = Deduplicator(params), _Counter()
    field = params.text_field
    kept_parts = _jsonl_kept(parts, dedup, counter, field) if fmt == "jsonl" else _parquet_kept(parts, dedup, counter, field)
    out = Path(ds.output_dir) / DEDUP_SUBDIR

    def checked():  # raising here, before the last part is written, leaves no deduplicated/ behind
        yield from kept_parts
        if counter.rows_in != merged_rows:
            raise DedupError(
                f"{merged}: holds {counter.rows_in} records, its merge manifest {manifest_path} counts {merged_rows}; "
                "the merged output changed after the merge: rerun the merge rule"
            )

    try:
        rows_out = write_merged(checked(), out, fmt)
    except PartUnreadable as e:
        raise DedupError(str(e)) from None
    removed = counter.exact + counter.near
    if rows_out + removed != counter.rows_in:  # the accounting: every record kept or listed as removed
        raise DedupError(f"{out}: {rows_out} records written + {removed} removed != {counter.rows_in} read")
    atomic_write_bytes(Path(removed_path), b"".join(counter.removed))
    counts = {
        "dataset": ds.path,
        "merged_dir": str(merged),
        "deduplicated_dir": str(out),
        "removed_list": str(removed_path),
        "format": fmt,
        "text_field": field,
        "exact": params.exact,
        "fuzzy": params.fuzzy,
        "threshold": params.threshold,
        "num_perm": params.num_perm,
        "shingle_size": params.shingle_size,
        "rows_in": counter.rows_in,
        "exact_duplicates_removed": counter.exact,
        "near_duplicates_removed": counter.near,
        "rows_out": rows_out,
        "rows_without_text": counter.rows_without_text,
        "seconds": round(time.monotonic() - started, 3),
    }
    atomic_write_json(Path(counts_path), counts)
    return counts


_PARAM_KEYS = ("text_field", "exact", "fuzzy", "threshold", "num_perm", "shingle_size")


def dedup_outputs(cfg: PipelineConfig, ds: DatasetConfig) -> list[Path]:
    """What the dedup rule builds for dataset ``ds``: counts, removed list, deduplicated/."""
    paths = StateLayout(cfg.state_dir)
    return [paths.dedup_counts(ds.index), paths.dedup_removed(ds.index), Path(ds.output_dir) / DEDUP_SUBDIR]


def dedup_params_changed(cfg: PipelineConfig, ds: DatasetConfig) -> tuple[str, bool]:
    """(digest of the current deduplication parameters, whether dataset ``ds``'s dedup outputs
    were made with other ones, or are damaged): the dedup rule's stamp (state/inputs.py), so
    it runs again whatever the rerun triggers (the cluster profile's ``mtime`` would not see
    a parameter change)."""
    new = {k: getattr(cfg.dedup, k) for k in _PARAM_KEYS}
    counts_path = dedup_outputs(cfg, ds)[0]
    try:
        counts = json.loads(counts_path.read_text(encoding="utf-8"))
        old = {k: counts[k] for k in _PARAM_KEYS}
    except FileNotFoundError:
        return digest_of(new), False  # never made: the rule runs anyway
    except (OSError, ValueError, KeyError, TypeError):
        old = None  # damaged: made again
    return digest_of(new), old != new


def remove_stale_dedup_outputs(cfg: PipelineConfig) -> list[str]:
    """Driver side, at DAG build: a dataset's dedup outputs made with other parameters are
    removed, so the rule runs again whatever the rerun triggers (the cluster profile's
    ``mtime`` would not see a parameter change). Returns notes for the user."""
    import shutil

    if cfg.dedup is None:
        return []
    notes = []
    for ds in cfg.datasets:
        counts_path, removed_path, out = dedup_outputs(cfg, ds)
        try:
            counts = json.loads(counts_path.read_text(encoding="utf-8"))
            old = {k: counts[k] for k in _PARAM_KEYS}
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError):
            old = None  # damaged: rebuilt like a changed one
        new = {k: getattr(cfg.dedup, k) for k in _PARAM_KEYS}
        if old == new:
            continue
        counts_path.unlink(missing_ok=True)
        removed_path.unlink(missing_ok=True)
        shutil.rmtree(out, ignore_errors=True)
        notes.append(f"deduplication_params changed: dataset {ds.index} ('{ds.path}') is deduplicated again")
    return notes


def read_dedup_counts(state_dir: str | Path) -> list[dict]:
    """Every dataset's dedup counts in ``<state_dir>/dedup/`` (for the report), by dataset
    number; a file that cannot be read is listed with its error instead of failing the report."""
    found = []
    for path in StateLayout(state_dir).dedup_count_files():
        try:
            counts = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(counts, dict):
                raise ValueError(f"a JSON {type(counts).__name__}, not an object")
        except (OSError, ValueError) as e:
            counts = {"error": f"{path}: cannot read ({type(e).__name__}: {e})"}
        found.append({"counts_file": str(path), **counts})
    return found


def dedup_problems(cfg: PipelineConfig) -> list[str]:
    """Driver side (preflight): a threshold below 1 that datasketch's MinHashLSH cannot band
    with num_perm permutations. Not in load_config: it imports datasketch (scipy) and costs
    up to ~0.2 s, which every cluster job would pay again."""
    p = cfg.dedup
    if p is None or not p.fuzzy or p.threshold >= 1:
        return []
    from datasketch import MinHashLSH

    try:
        MinHashLSH(threshold=p.threshold, num_perm=p.num_perm, weights=LSH_WEIGHTS)
    except ValueError as e:
        return [
            f"deduplication_params.threshold: {p.threshold} with num_perm {p.num_perm} cannot be indexed by "
            f"datasketch's MinHashLSH ({e}); raise num_perm, lower the threshold, or use threshold: 1 (equal signatures only)"
        ]
    return []


def produced_fields(output_schema: dict, outputs: list[OutputVar], preserve_columns: Iterable[str]) -> list[str]:
    """Top-level record fields the config itself produces (besides source columns when
    remove_columns is false): output_schema's keys, else the outputs; preserved columns."""
    if output_schema:
        produced = list(output_schema)
    else:
        produced = [o.name for o in outputs if o.kind != "filter"]
        produced += [f"{o.name}_reasoning" for o in outputs if o.keep_reasoning]
    produced += [f"{o.name}_{k}" for o in outputs if o.kind == "image_gen" for k in ("path", "seed")]  # every record has them
    return produced + list(preserve_columns)


def text_field_sample_problems(cfg: PipelineConfig, ds: DatasetConfig, sample: list) -> list[str]:
    """Driver side (preflight): with remove_columns false, a text_field the config does not
    produce must be a column of the dataset: refused when none of its first rows has it."""
    p = cfg.dedup
    produced = produced_fields(cfg.output_schema, cfg.outputs, cfg.preserve_columns)
    if p is None or cfg.remove_columns or p.text_field in produced:
        return []
    if any(isinstance(row, dict) and p.text_field in row for row in sample):
        return []
    columns = sorted({str(k) for row in sample if isinstance(row, dict) for k in row})
    return [
        f"deduplication_params.text_field: '{p.text_field}' is neither a field the config produces "
        f"({', '.join(produced) or 'none'}) nor a column of the first {len(sample)} rows of "
        f"loading_params.datasets[{ds.index}] ('{ds.path}'; columns: {', '.join(columns[:20])})"
    ]
