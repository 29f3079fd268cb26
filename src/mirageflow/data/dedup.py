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
- ``fuzzy`` then removes near duplicates with datasketch's values (computed with numpy,
  data/minhash.py: datasketch is only the tests' reference): a MinHash (``num_perm``
  permutations, seed 1) of the normalised text's character shingles of ``shingle_size``
  characters (a text shorter than that is one shingle; each shingle hashed by zlib's
  CRC-32: datasketch's default SHA-1 made the pass ~1.7x slower for the same recall),
  banded as datasketch's MinHashLSH bands it at ``threshold`` (weighted to favour recall:
  ``LSH_WEIGHTS``): records sharing a band are candidates, some below the threshold: a
  record is removed only when an earlier *kept* candidate's estimated Jaccard similarity
  (the share of equal MinHash values) reaches ``threshold``; it then names the earliest
  such kept record (greedy in merged order: A~B, B~C, A!~C keeps A and C).
  ``threshold: 1`` means equal MinHash signatures (a dictionary; LSH cannot band it). A
  threshold close to 1 with few permutations leaves datasketch fewer than 2 bands: the
  driver refuses it (``dedup_problems``), naming the key.

Nothing is lost silently: ``<state_dir>/dedup/dataset_<ds>.removed.jsonl`` lists every
removed record (``row``: its position in merged order, its ``source_index``, ``kind``
exact or near, ``duplicate_of_row`` and ``duplicate_of``: the kept record's position and
source_index, with n_samples the two ``sample_index`` values, and for ``near`` the
estimated ``similarity``), and the rule checks rows_in = rows_out + removed.

The work runs in stages of parallel jobs, each with a bounded share of the data
(data/dedup_stages.py: signatures per group of merged parts, candidate pairs per band
partition, the decisions in one small job, the kept records written per group of merged
parts, then deduplicated/ put in place with the removed list and the counts); this module holds the rule, its parameters
and the driver's checks (light: no numpy, imported when the workflow is parsed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from mirageflow.config.types import DatasetConfig, OutputVar, PipelineConfig
from mirageflow.files import digest_of
from mirageflow.errors import MirageflowError
from mirageflow.state.layout import StateLayout

DEDUP_SUBDIR = "deduplicated"
# the directory the parallel dedup_write jobs write deduplicated/'s parts into, next to it; the
# last stage puts it in place (a rename: a reader sees the old deduplicated/ or the new one)
DEDUP_STAGING = f".{DEDUP_SUBDIR}.parts"
DEDUP_RULES = [
    "dedup_signatures",
    "dedup_pairs",
    "dedup_decide",
    "dedup_write",
    "dedup",
]  # the workflow's dedup stages (workflow/rules/dedup.smk)
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


# One dedup job per this many shards: a stage job's memory follows the rows of its shards
# (its share of the entries), and a job's fixed cost (imports; a cluster job's parse) is
# paid once per 8 shards rather than per shard.
SHARDS_PER_DEDUP_JOB = 8
MAX_PARTITIONS = 256  # each pairs job opens every signatures job's files


def dedup_partitions(cfg: PipelineConfig) -> int:
    """How many parallel jobs each dedup stage runs (and band partitions): one per 8 shards,
    at least 1, at most MAX_PARTITIONS (the workflow's rules and the jobs agree through this)."""
    return max(1, min(-(-int(cfg.num_shards) // SHARDS_PER_DEDUP_JOB), MAX_PARTITIONS))


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
        shutil.rmtree(out.with_name(DEDUP_STAGING), ignore_errors=True)
        shutil.rmtree(StateLayout(cfg.state_dir).dedup_work(ds.index), ignore_errors=True)  # the stages' files
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
    with num_perm permutations (data/minhash.py finds its banding, with numpy). Not in
    load_config: it costs ~10-50 ms, which every cluster job would pay again."""
    p = cfg.dedup
    if p is None or not p.fuzzy or p.threshold >= 1:
        return []
    from mirageflow.data.minhash import lsh_bands

    try:
        lsh_bands(p.threshold, p.num_perm, LSH_WEIGHTS)
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
