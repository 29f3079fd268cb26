"""Deduplication in stages that run as parallel jobs, each holding a bounded share of the data
(what is removed, and why, is data/dedup.py's rule: this module computes the same result).

The split follows DataTrove's and NeMo Curator's MinHash dedup (signatures, band buckets,
clusters), keeping today's keeper rule, which is greedy in merged order: a record is removed
when it duplicates an earlier *kept* record (so A~B, B~C, A!~C keeps A and C).

A record is named by its row id, ``part << 32 | position in the part`` (merged order).

1. ``signatures`` (job k of P): the merged parts k, k+P, k+2P, ... one at a time. For every
   record with a text: its MinHash signature (one row of ``sig``, by position; zeros for a
   record without text) and two kinds of entries, each sorted by the partition it belongs to
   (P partitions, the offsets in the meta file):
   - a *class* entry: (class digest, text digest, row), in partition ``class % P``. A class
     is the records with equal signatures (fuzzy) or equal normalised texts (exact only),
     named by the BLAKE2b-128 of the signature or the text's digest.
   - *band* entries (fuzzy, threshold < 1): one per LSH band (the bands datasketch's
     MinHashLSH uses for this threshold and num_perm): (band key, band, class, row), in
     partition ``key % P``.
2. ``pairs`` (partition p of P): only partition p's entries of every job (a slice of each
   file), so its memory is its share of the entries, plus the signatures of the records
   that share a band bucket with another class. It writes the edges (row, earlier row):
   - each class member after the first -> the class's first record (its *representative*);
   - representatives sharing a bucket whose estimated Jaccard similarity (the share of equal
     MinHash values) reaches the threshold, emitted in the lowest band where they agree only
     (once per pair). Equal signatures are one class, so an all-duplicates bucket costs one
     entry per class, not one pair per two records.
3. ``decisions`` (one job): every edge, in row order (memory: the edges, i.e. the
   duplicates, not the rows), decides greedily as today: the removed rows, each with the
   kept row it duplicates, kind and similarity (``decisions.npy``, sorted by row).
4. ``kept`` (job k of P, the parts of stage 1's job k): each part read once more, one at a
   time, and written without its removed rows into ``<output_dir>/.deduplicated.parts/``
   (read = written + removed, or it fails); its report names each part file (size, mtime)
   and the source_index/sample_index of its removed rows and of its kept rows that a
   removed row names (what the removed list needs of its parts).
5. ``deduplicated/`` in place (one job): every report checked against the merge manifest
   and the decisions, the parts directory renamed to ``deduplicated/`` at once, and the
   removed list in row order with the counts.

Why the class collapse keeps today's result: records with equal signatures have the same
candidates and similarities, so the first one decides for all; the later ones are removed
(exact when exact is on and their text equals the first's, else near with similarity 1), or,
when the first was removed, as near duplicates of what removed it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from mirageflow.config.types import DatasetConfig, DedupParams, PipelineConfig
from mirageflow.data.minhash import affine32_permutations, lsh_bands
from mirageflow.data.dedup import DEDUP_STAGING, DEDUP_SUBDIR, LSH_WEIGHTS, MINHASH_SEED, DedupError, normalize, shingles
from mirageflow.data.writers import is_json_field, jsonl_line, merged_part_name, replace_dir, write_merged_part
from mirageflow.files import atomic_write_bytes, atomic_write_json
from mirageflow.state.layout import StateLayout, merged_dir

BAND_ENTRY = np.dtype([("key", "<u8"), ("cls", "<u8"), ("row", "<u8"), ("band", "<u2")])
CLASS_ENTRY = np.dtype([("c0", "<u8"), ("c1", "<u8"), ("t0", "<u8"), ("t1", "<u8"), ("row", "<u8")])
EDGE = np.dtype([("row", "<u8"), ("of", "<u8"), ("sim", "<f8"), ("kind", "u1")])
EDGE_NEAR, EDGE_CLASS, EDGE_CLASS_SAME_TEXT = 0, 1, 2
PART_SHIFT = 32
_PARAM_KEYS = ("text_field", "exact", "fuzzy", "threshold", "num_perm", "shingle_size")


def bands_of(params: DedupParams) -> tuple[int, int]:
    """(bands, rows per band) of datasketch's MinHashLSH for these parameters (data/minhash.py
    computes them without datasketch); (0, 0) when there is no banding (exact only, or
    threshold 1: equal signatures)."""
    if not params.fuzzy or params.threshold >= 1:
        return 0, 0
    try:
        return lsh_bands(params.threshold, params.num_perm, LSH_WEIGHTS)
    except ValueError as e:  # the driver refuses this config (dedup_problems); a job run by hand may not have
        raise DedupError(f"deduplication_params.threshold: {params.threshold} with num_perm {params.num_perm}: {e}") from None


def _params_record(params: DedupParams, partitions: int) -> dict:
    return {**{k: getattr(params, k) for k in _PARAM_KEYS}, "partitions": partitions}


def _save_npy(path: Path, array) -> None:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    atomic_write_bytes(path, buf.getvalue())


def merged_parts(merged: Path, fmt: str) -> list[Path]:
    if not merged.is_dir():
        raise DedupError(f"{merged}: no merged output to deduplicate (the merge rule writes it)")
    return sorted(merged.glob(f"part-*.{fmt}"))


# --------------------------------------------------------------------------- reading a merged part


def part_records(path: Path, fmt: str, field: str, wanted: set[int] | None = None) -> Iterator[tuple[Any, Any]]:
    """(text or None, record) of each record of a merged part, in order; ``record`` is a dict
    of the text, source_index and sample_index, or (JSONL) the line, whose fields are read
    only for the positions in ``wanted`` (None: none; the record is then None)."""
    if fmt == "jsonl":
        try:
            with open(path, "rb") as f:
                position = 0
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line) if wanted is None or position in wanted else None
                    except ValueError as e:
                        raise DedupError(f"{path}:{lineno}: not a JSON record ({e})") from None
                    yield record, line if line.endswith(b"\n") else line + b"\n"
                    position += 1
        except OSError as e:
            raise DedupError(f"{path}: cannot read this merged part ({e})") from None
        return
    raise ValueError(fmt)


def parquet_part(path: Path, field: str, text_only: bool = False):
    """(table, {column: values}) of a merged Parquet part: the text, source_index and
    sample_index columns (JSON-encoded ones decoded); ``text_only``: the text column alone read."""
    import pyarrow.parquet as pq

    try:
        if text_only:
            names = pq.read_schema(path).names
            table = pq.read_table(path, columns=[field] if field in names else [])
        else:
            table = pq.read_table(path)
    except Exception as e:
        raise DedupError(f"{path}: cannot read this merged Parquet part ({type(e).__name__}: {e})") from e
    columns = {}
    for name in (field, "source_index", "sample_index"):
        if name in table.column_names:
            values = table.column(name).to_pylist()
            if is_json_field(table.schema.field(name)):  # JSON text: the values are what it decodes to
                values = [json.loads(v) if v is not None else None for v in values]
            columns[name] = values
    return table, columns


def _texts(path: Path, fmt: str, field: str) -> list:
    """The text of each record of a part (None: no text: missing, null, not a string)."""
    if fmt == "jsonl":
        out = []
        for record, _ in part_records(path, fmt, field, wanted=None):
            text = record.get(field) if isinstance(record, dict) else None
            out.append(text if isinstance(text, str) else None)
        return out
    table, columns = parquet_part(path, field, text_only=True)
    values = columns.get(field, [None] * table.num_rows)
    return [v if isinstance(v, str) else None for v in values]


# --------------------------------------------------------------------------- stage 1: signatures


class Signer:
    """datasketch's MinHash of a normalised text (``num_perm`` permutations, seed 1, its
    ``affine32`` scheme: CRC-32 of each shingle, MurmurHash3's 32-bit finalizer, then
    ``a * h + b`` mod 2**32, the least per permutation), computed for the whole text at once
    with numpy: the same values as ``MinHash(...).update_batch`` of the shingles (tests check
    it), ~5x faster. An ASCII text's shingles are hashed by tables (CRC-32 is affine over
    GF(2): a k-byte message's CRC is the XOR of one table entry per byte position, and a
    constant); any other text's by zlib, shingle by shingle."""

    CHUNK = 4096  # shingles at a time: a (CHUNK x num_perm) product in memory

    def __init__(self, params: DedupParams):
        self._a, self._b = affine32_permutations(params.num_perm, MINHASH_SEED)
        self.k = k = params.shingle_size
        self._zero = np.uint32(zlib.crc32(bytes(k)))
        tables = np.zeros((k, 256), dtype=np.uint32)
        for position in range(k):
            for byte in range(256):
                message = bytearray(k)
                message[position] = byte
                tables[position, byte] = zlib.crc32(bytes(message)) ^ int(self._zero)
        self._tables = tables

    def shingle_hashes(self, norm: str):
        """CRC-32 of each k-character shingle of ``norm`` (repeats included: a minimum ignores them)."""
        data = norm.encode("utf-8")
        k = self.k
        if len(norm) < k:
            return np.array([zlib.crc32(data)], dtype=np.uint32)
        if len(data) != len(norm):  # not ASCII: a character may take several bytes
            return np.fromiter((zlib.crc32(s) for s in shingles(norm, k)), dtype=np.uint32)
        text = np.frombuffer(data, dtype=np.uint8)
        n = len(text) - k + 1
        hashes = np.full(n, self._zero, dtype=np.uint32)
        for position in range(k):
            hashes ^= self._tables[position][text[position : position + n]]
        return hashes

    def signature(self, norm: str):
        h = self.shingle_hashes(norm)
        with np.errstate(over="ignore"):
            h = h ^ (h >> np.uint32(16))
            h = h * np.uint32(0x85EBCA6B)
            h = h ^ (h >> np.uint32(13))
            h = h * np.uint32(0xC2B2AE35)
            h = h ^ (h >> np.uint32(16))
            out = None
            for start in range(0, len(h), self.CHUNK):
                least = (h[start : start + self.CHUNK, None] * self._a + self._b).min(axis=0)
                out = least if out is None else np.minimum(out, least)
        return out


def _band_keys(sigs, bands: int, rows: int):
    """A 64-bit key per (record, band) of the band's values (a collision only adds a
    candidate: stage 2 checks that the band's values are equal)."""
    keys = np.empty((len(sigs), bands), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for b in range(bands):
            h = np.full(len(sigs), np.uint64(0x9E3779B97F4A7C15) * np.uint64(b + 1), dtype=np.uint64)
            for v in sigs[:, b * rows : (b + 1) * rows].T.astype(np.uint64):
                h = (h ^ v) * np.uint64(0x100000001B3)
                h ^= h >> np.uint64(29)
            keys[:, b] = h
    return keys


def _by_partition(entries, partition_of, partitions: int):
    order = np.argsort(partition_of, kind="stable")
    counts = np.bincount(partition_of, minlength=partitions)
    offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
    return entries[order], offsets


def write_signatures(merged: Path, fmt: str, params: DedupParams, partitions: int, job: int, files: dict[str, Path]) -> dict:
    """Stage 1, job ``job``: the parts ``job``, ``job + partitions``, ... of ``merged``."""
    parts = merged_parts(merged, fmt)
    signer = Signer(params) if params.fuzzy else None
    bands, band_rows = bands_of(params)
    sig_rows, class_rows, band_rows_out, meta_parts = [], [], [], []
    field = params.text_field
    for index in range(job, len(parts), partitions):
        path = parts[index]
        texts = _texts(path, fmt, field)
        n = len(texts)
        sigs = np.zeros((n, params.num_perm if params.fuzzy else 0), dtype=np.uint32)
        cls = np.zeros((n, 2), dtype=np.uint64)
        txt = np.zeros((n, 2), dtype=np.uint64)
        with_text = np.zeros(n, dtype=bool)
        for i, text in enumerate(texts):
            if text is None:
                continue
            with_text[i] = True
            norm = normalize(text)
            if params.exact:
                txt[i] = np.frombuffer(hashlib.blake2b(norm.encode("utf-8"), digest_size=16).digest(), dtype=np.uint64)
            if params.fuzzy:
                sigs[i] = signer.signature(norm)
                cls[i] = np.frombuffer(hashlib.blake2b(sigs[i].tobytes(), digest_size=16).digest(), dtype=np.uint64)
            else:
                cls[i] = txt[i]
        ids = (np.uint64(index) << np.uint64(PART_SHIFT)) | np.arange(n, dtype=np.uint64)
        keep = with_text
        entries = np.zeros(int(keep.sum()), dtype=CLASS_ENTRY)
        entries["c0"], entries["c1"] = cls[keep, 0], cls[keep, 1]
        entries["t0"], entries["t1"] = txt[keep, 0], txt[keep, 1]
        entries["row"] = ids[keep]
        class_rows.append(entries)
        if bands:
            keys = _band_keys(sigs[keep], bands, band_rows)
            b_entries = np.zeros(keys.size, dtype=BAND_ENTRY)
            b_entries["key"] = keys.reshape(-1)
            b_entries["cls"] = np.repeat(cls[keep, 0], bands)
            b_entries["row"] = np.repeat(ids[keep], bands)
            b_entries["band"] = np.tile(np.arange(bands, dtype=np.uint16), int(keep.sum()))
            band_rows_out.append(b_entries)
        sig_rows.append(sigs)
        meta_parts.append({"index": index, "name": path.name, "rows": n, "without_text": int(n - keep.sum())})
    classes = np.concatenate(class_rows) if class_rows else np.zeros(0, dtype=CLASS_ENTRY)
    classes, class_offsets = _by_partition(classes, (classes["c0"] % np.uint64(partitions)).astype(np.int64), partitions)
    band_entries = np.concatenate(band_rows_out) if band_rows_out else np.zeros(0, dtype=BAND_ENTRY)
    band_entries, band_offsets = _by_partition(band_entries, (band_entries["key"] % np.uint64(partitions)).astype(np.int64), partitions)
    sig = np.concatenate(sig_rows) if sig_rows else np.zeros((0, params.num_perm if params.fuzzy else 0), dtype=np.uint32)
    _save_npy(files["sig"], sig)
    _save_npy(files["classes"], classes)
    _save_npy(files["bands"], band_entries)
    meta = {
        "params": _params_record(params, partitions),
        "job": job,
        "merged_parts": len(parts),
        "parts": meta_parts,
        "bands": bands,
        "band_rows": band_rows,
        "class_offsets": class_offsets,
        "band_offsets": band_offsets,
    }
    atomic_write_json(files["meta"], meta)  # last: the job's completion
    return meta


# --------------------------------------------------------------------------- stage 2: pairs


def read_metas(signature_files: list[dict[str, Path]], params: DedupParams, partitions: int) -> list[dict]:
    """Every stage 1 job's meta, checked against these parameters (a stale one is refused)."""
    expected = _params_record(params, partitions)
    metas = []
    for job, files in enumerate(signature_files):
        try:
            meta = json.loads(files["meta"].read_text(encoding="utf-8"))
            if meta["params"] != expected or meta["job"] != job:
                raise ValueError(f"made for {meta['params']} (job {meta['job']}), not {expected} (job {job})")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DedupError(f"{files['meta']}: not this dedup's stage 1 output ({type(e).__name__}: {e}); rerun the workflow") from None
        metas.append(meta)
    return metas


def _slice(path: Path, start: int, stop: int):
    """Rows [start, stop) of a .npy file, read alone (memory-mapped, then copied)."""
    try:
        whole = np.load(path, mmap_mode="r", allow_pickle=False)
        return np.array(whole[start:stop])
    except (OSError, ValueError) as e:
        raise DedupError(f"{path}: cannot read this dedup stage file ({type(e).__name__}: {e}); rerun the workflow") from None


def _class_edges(entries, exact: bool):
    """Each class member after the first -> the first (entries: one partition's); ``exact``:
    a member whose text equals the first's is an exact duplicate."""
    if len(entries) == 0:
        return np.zeros(0, dtype=EDGE)
    entries = entries[np.lexsort((entries["row"], entries["c1"], entries["c0"]))]
    same = (entries["c0"][1:] == entries["c0"][:-1]) & (entries["c1"][1:] == entries["c1"][:-1])
    first = np.concatenate([[True], ~same])
    head = np.maximum.accumulate(np.where(first, np.arange(len(entries)), 0))  # each entry's class's first entry
    members = ~first
    rep = entries[head[members]]
    m = entries[members]
    edges = np.zeros(int(members.sum()), dtype=EDGE)
    edges["row"], edges["of"], edges["sim"] = m["row"], rep["row"], 1.0
    same_text = (m["t0"] == rep["t0"]) & (m["t1"] == rep["t1"]) & exact
    edges["kind"] = np.where(same_text, EDGE_CLASS_SAME_TEXT, EDGE_CLASS)
    return edges


def _signatures_of(rows, metas: list[dict], signature_files: list[dict[str, Path]], partitions: int):
    """The signatures of ``rows`` (sorted unique row ids), read from each job's sig file."""
    parts = rows >> np.uint64(PART_SHIFT)
    positions = rows & np.uint64((1 << PART_SHIFT) - 1)
    num_perm = metas[0]["params"]["num_perm"]
    out = np.zeros((len(rows), num_perm), dtype=np.uint32)
    for job, meta in enumerate(metas):
        mine = (parts % np.uint64(partitions)) == np.uint64(job)
        if not mine.any():
            continue
        start, offset = {}, 0
        for p in meta["parts"]:
            start[p["index"]] = offset
            offset += p["rows"]
        where = np.array([start[int(x)] for x in parts[mine]], dtype=np.int64) + positions[mine].astype(np.int64)
        try:
            sig = np.load(signature_files[job]["sig"], mmap_mode="r", allow_pickle=False)
            out[mine] = sig[where]
        except (OSError, ValueError, IndexError) as e:
            raise DedupError(
                f"{signature_files[job]['sig']}: cannot read these signatures ({type(e).__name__}: {e}); rerun the workflow"
            ) from None
    return out


def _near_edges(entries, metas, signature_files, partitions: int, threshold: float, bands: int, band_rows: int):
    """Representatives sharing a band bucket, at or above the threshold, in their lowest common band."""
    if len(entries) == 0:
        return np.zeros(0, dtype=EDGE)
    # one entry per (bucket, class): its first record (the class's representative)
    entries = entries[np.lexsort((entries["row"], entries["cls"], entries["band"], entries["key"]))]
    bucket_same = (entries["key"][1:] == entries["key"][:-1]) & (entries["band"][1:] == entries["band"][:-1])
    dup = bucket_same & (entries["cls"][1:] == entries["cls"][:-1])
    entries = entries[np.concatenate([[True], ~dup])]
    entries = entries[np.lexsort((entries["row"], entries["band"], entries["key"]))]
    bucket_same = (entries["key"][1:] == entries["key"][:-1]) & (entries["band"][1:] == entries["band"][:-1])
    starts = np.flatnonzero(np.concatenate([[True], ~bucket_same]))
    ends = np.concatenate([starts[1:], [len(entries)]])
    shared = ends - starts >= 2
    starts, ends = starts[shared], ends[shared]
    if len(starts) == 0:
        return np.zeros(0, dtype=EDGE)
    in_buckets = np.concatenate([entries["row"][s:e] for s, e in zip(starts, ends)])
    rows = np.unique(in_buckets)
    sigs = _signatures_of(rows, metas, signature_files, partitions)
    out = []
    for s, e in zip(starts.tolist(), ends.tolist()):
        b = int(entries["band"][s])
        members = entries["row"][s:e]  # ascending
        sig = sigs[np.searchsorted(rows, members)]
        for i in range(1, len(members)):
            equal = sig[:i] == sig[i]
            sim = equal.mean(axis=1)
            hit = sim >= threshold
            if not hit.any():
                continue
            agree = equal[:, : bands * band_rows].reshape(i, bands, band_rows).all(axis=2)
            lowest = np.argmax(agree, axis=1)
            hit &= agree[:, b] & (lowest == b)
            for j in np.flatnonzero(hit).tolist():
                out.append((int(members[i]), int(members[j]), float(sim[j]), EDGE_NEAR))
    return np.array(out, dtype=EDGE)


def write_pairs(params: DedupParams, partitions: int, partition: int, signature_files: list[dict[str, Path]], out: Path) -> int:
    """Stage 2, partition ``partition``: its slice of every job's entries -> its edges."""
    metas = read_metas(signature_files, params, partitions)
    lo, hi = partition, partition + 1
    classes = [_slice(f["classes"], m["class_offsets"][lo], m["class_offsets"][hi]) for f, m in zip(signature_files, metas)]
    edges = [_class_edges(np.concatenate(classes) if classes else np.zeros(0, dtype=CLASS_ENTRY), params.exact)]
    bands, band_rows = metas[0]["bands"], metas[0]["band_rows"]
    if bands:
        entries = [_slice(f["bands"], m["band_offsets"][lo], m["band_offsets"][hi]) for f, m in zip(signature_files, metas)]
        edges.append(_near_edges(np.concatenate(entries), metas, signature_files, partitions, params.threshold, bands, band_rows))
    found = np.concatenate(edges)
    found = found[np.lexsort((found["of"], found["row"]))]
    _save_npy(out, found)
    return len(found)


# --------------------------------------------------------------------------- stage 3: clusters


def decide(edges) -> dict[int, tuple[str, int, float | None]]:
    """Row id -> (kind, kept row id it duplicates, similarity or None): today's greedy rule
    over the edges, in row order (a row's edges all point to earlier rows)."""
    removed: dict[int, tuple[str, int, float | None]] = {}
    if len(edges) == 0:
        return removed
    edges = edges[np.lexsort((edges["of"], edges["row"]))]
    rows, ofs, sims, kinds = (edges[k].tolist() for k in ("row", "of", "sim", "kind"))
    n, i = len(rows), 0
    while i < n:
        row, j = rows[i], i
        while j < n and rows[j] == row:
            j += 1
        if kinds[i] != EDGE_NEAR:  # a class member: its representative decides
            rep = ofs[i]
            first = removed.get(rep)
            if first is not None:
                removed[row] = ("near", first[1], first[2])
            elif kinds[i] == EDGE_CLASS_SAME_TEXT:
                removed[row] = ("exact", rep, None)
            else:
                removed[row] = ("near", rep, 1.0)
        else:
            for k in range(i, j):  # ascending earlier rows: the first kept one
                if ofs[k] not in removed:
                    removed[row] = ("near", ofs[k], round(sims[k], 4))
                    break
        i = j
    return removed


def load_edges(paths: list[Path]):
    found = []
    for path in paths:
        try:
            found.append(np.load(path, allow_pickle=False))
        except (OSError, ValueError) as e:
            raise DedupError(f"{path}: cannot read these dedup edges ({type(e).__name__}: {e}); rerun the workflow") from None
    return np.concatenate(found) if found else np.zeros(0, dtype=EDGE)


def removed_entry(row: int, ident: tuple, kind: str, first: tuple, similarity: float | None) -> bytes:
    """A line of the removed list (idents: (row, source_index, sample_index))."""
    entry = {"row": row, "source_index": ident[1], "kind": kind, "duplicate_of_row": first[0], "duplicate_of": first[1]}
    if ident[2] is not None or first[2] is not None:
        entry["sample_index"], entry["duplicate_of_sample"] = ident[2], first[2]
    if similarity is not None:
        entry["similarity"] = similarity
    return jsonl_line(entry)


# --------------------------------------------------------------------------- stage 3: decisions

DECISION = np.dtype([("row", "<u8"), ("of", "<u8"), ("sim", "<f8"), ("kind", "u1")])  # sim: NaN for none
KINDS = ("exact", "near")
_POSITION = (1 << PART_SHIFT) - 1


def _checked_parts(cfg: PipelineConfig, ds: DatasetConfig, params: DedupParams, partitions: int):
    """(state layout, stage 1's metas, merged/'s parts, part index -> its meta entry), the
    parts checked against those their signatures were computed from."""
    paths = StateLayout(cfg.state_dir)
    merged = merged_dir(ds.output_dir)
    metas = read_metas([paths.dedup_signatures(ds.index, k) for k in range(partitions)], params, partitions)
    parts = merged_parts(merged, ds.output_format)
    seen = {p["index"]: p for m in metas for p in m["parts"]}
    if sorted(seen) != list(range(len(parts))) or any(seen[i]["name"] != parts[i].name for i in range(len(parts))):
        raise DedupError(f"{merged}: its parts changed since their signatures were computed; rerun the workflow")
    return paths, metas, parts, seen


def write_decisions(cfg: PipelineConfig, ds: DatasetConfig, params: DedupParams, partitions: int) -> int:
    """Stage 3 (one job): every partition's edges, in row order, decide (today's greedy rule);
    the removed rows, sorted, with what each duplicates. Memory: the edges, not the rows."""
    paths = _checked_parts(cfg, ds, params, partitions)[0]
    removed = decide(load_edges([paths.dedup_edges(ds.index, k) for k in range(partitions)]))
    rows = sorted(removed)
    out = np.zeros(len(rows), dtype=DECISION)
    out["row"] = rows
    out["of"] = [removed[r][1] for r in rows]
    out["sim"] = [np.nan if removed[r][2] is None else removed[r][2] for r in rows]
    out["kind"] = [KINDS.index(removed[r][0]) for r in rows]
    _save_npy(paths.dedup_decisions(ds.index), out)
    return len(out)


def _decisions(path: Path, mmap: bool = False):
    """(the decisions, their file's identity: size and mtime, which the writers' reports name)."""
    try:
        decisions = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
        if decisions.dtype != DECISION:
            raise ValueError(f"dtype {decisions.dtype}")
        st = path.stat()
    except (OSError, ValueError) as e:
        raise DedupError(f"{path}: cannot read the dedup decisions ({type(e).__name__}: {e}); rerun the workflow") from None
    return decisions, [st.st_size, st.st_mtime_ns]


# --------------------------------------------------------------------------- stage 4: the kept records


def _without(path: Path, fmt: str, field: str, gone: list[int], named: set[int]):
    """(part ``path`` without the records at positions ``gone``: JSONL lines or an Arrow table,
    the records it holds, {position: record} of those in ``gone`` or ``named``)."""
    wanted = set(gone) | named
    found: dict[int, dict] = {}
    if fmt == "jsonl":
        kept, n, drop = [], 0, set(gone)
        for record, line in part_records(path, fmt, field, wanted):
            if n in wanted:
                found[n] = record if isinstance(record, dict) else {}
            if n not in drop:
                kept.append(line)
            n += 1
        return kept, n, found
    import pyarrow as pa

    table, columns = parquet_part(path, field)
    n = table.num_rows
    for pos in wanted:
        if pos < n:
            found[pos] = {name: values[pos] for name, values in columns.items()}
    mask = [True] * n
    for pos in gone:
        if pos < n:
            mask[pos] = False
    return table.filter(pa.array(mask, type=pa.bool_())), n, found


def _file_id(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns]


def write_kept(cfg: PipelineConfig, ds: DatasetConfig, params: DedupParams, partitions: int, job: int) -> dict:
    """Stage 4, job ``job`` (the merged parts ``job``, ``job + partitions``, ... as in stage 1):
    each part without its removed records, into ``deduplicated/``'s staging directory, one
    part at a time; its report: per part the records read, written and removed (read =
    written + removed, or it fails) and the file written, and the source_index and
    sample_index of its removed records and of its kept ones that a removed record names."""
    paths, metas, parts, seen = _checked_parts(cfg, ds, params, partitions)
    fmt, field = ds.output_format, params.text_field
    decisions, decisions_id = _decisions(paths.dedup_decisions(ds.index), mmap=True)
    mine = [p["index"] for p in metas[job]["parts"]]
    rows = decisions["row"]
    named_rows = np.asarray(decisions["of"])
    named_rows = named_rows[np.isin(named_rows >> np.uint64(PART_SHIFT), np.array(mine, dtype=np.uint64))]
    staging = Path(ds.output_dir) / DEDUP_STAGING
    staging.mkdir(parents=True, exist_ok=True)
    report_parts, idents = [], []
    for index in mine:
        path, base = parts[index], index << PART_SHIFT
        lo, hi = np.searchsorted(rows, np.array([base, base + (1 << PART_SHIFT)], dtype=np.uint64)).tolist()
        gone = [r & _POSITION for r in rows[lo:hi].tolist()]
        named = {r & _POSITION for r in named_rows[(named_rows >> np.uint64(PART_SHIFT)) == np.uint64(index)].tolist()}
        kept, n, found = _without(path, fmt, field, gone, named)
        if n != seen[index]["rows"]:
            raise DedupError(f"{path}: holds {n} records, {seen[index]['rows']} when its signatures were computed; rerun the workflow")
        beyond = [pos for pos in sorted(set(gone) | named) if pos >= n]
        if beyond:
            raise DedupError(f"{paths.dedup_decisions(ds.index)}: names record {beyond[0]} of {path}, which holds {n}; rerun the workflow")
        target = staging / merged_part_name(index, fmt)
        try:
            written = write_merged_part(target, kept, fmt)
        except OSError as e:
            raise DedupError(f"{target}: cannot write this deduplicated part ({type(e).__name__}: {e})") from None
        if written + len(gone) != n:  # the accounting: every record kept or removed
            raise DedupError(f"{target}: {written} records written + {len(gone)} removed != {n} read from {path}")
        report_parts.append(
            {"index": index, "name": target.name, "rows_in": n, "rows_out": written, "removed": len(gone), "file": _file_id(target)}
        )
        idents += [[base | pos, record.get("source_index"), record.get("sample_index")] for pos, record in sorted(found.items())]
    report = {
        "params": _params_record(params, partitions),
        "job": job,
        "decisions": decisions_id,
        "parts": report_parts,
        "idents": idents,
    }
    atomic_write_json(paths.dedup_written(ds.index, job), report, indent=None)
    return report


# --------------------------------------------------------------------------- stage 5: deduplicated/ in place


def _reports(paths: StateLayout, ds: DatasetConfig, params: DedupParams, partitions: int, decisions_id: list[int]) -> list[dict]:
    expected = _params_record(params, partitions)
    reports = []
    for job in range(partitions):
        path = paths.dedup_written(ds.index, job)
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
            if report["params"] != expected or report["job"] != job or report["decisions"] != decisions_id:
                raise ValueError(f"made for {report['params']} (job {report['job']}) from other decisions, not {expected} (job {job})")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DedupError(
                f"{path}: not this dedup's stage 4 report ({type(e).__name__}: {e}); remove it and rerun the workflow"
            ) from None
        reports.append(report)
    return reports


def _assemble(staging: Path, out: Path, expected: dict[str, tuple[list[int], Path]]) -> None:
    """Put the parts the stage 4 jobs wrote (name -> (their size and mtime, the report naming
    them)) in place of ``out`` at once. A part already moved there by an earlier run of this
    stage (stopped after the move) is linked back; anything else in the staging directory
    (a killed job's temp file) is dropped; a part missing or changed fails."""
    staging.mkdir(parents=True, exist_ok=True)
    for name, (file_id, report) in expected.items():
        target = staging / name
        if _file_id(target) == file_id:
            continue
        earlier = out / name
        if _file_id(earlier) != file_id:
            raise DedupError(f"{target}: missing, or not the part {report} says it wrote; remove {report} and rerun the workflow")
        target.unlink(missing_ok=True)
        try:
            os.link(earlier, target)
        except OSError:  # no hard links here: a copy keeps the size and mtime
            shutil.copy2(earlier, target)
    for extra in staging.iterdir():
        if extra.name not in expected:
            shutil.rmtree(extra) if extra.is_dir() and not extra.is_symlink() else extra.unlink()
    replace_dir(staging, out)


def write_deduplicated(
    cfg: PipelineConfig, ds: DatasetConfig, params: DedupParams, partitions: int, counts_path: str | Path, removed_path: str | Path,
    started: float | None = None,
) -> dict:  # fmt: skip
    """The last stage (one job): the stage 4 jobs' parts in place as ``deduplicated/``, the
    removed list (in row order, from the decisions and the jobs' reports) and the counts,
    after checking every part's accounting against the merge manifest and the decisions."""
    started = time.monotonic() if started is None else started
    fmt, field = ds.output_format, params.text_field
    paths, _, parts, seen = _checked_parts(cfg, ds, params, partitions)
    merged = merged_dir(ds.output_dir)
    merged_rows = _merged_rows(cfg, ds)
    rows_in = sum(p["rows"] for p in seen.values())
    if rows_in != merged_rows:
        raise DedupError(
            f"{merged}: holds {rows_in} records, its merge manifest {paths.merge_manifest(ds.index)} counts {merged_rows}; "
            "the merged output changed after the merge: rerun the merge rule"
        )
    decisions, decisions_id = _decisions(paths.dedup_decisions(ds.index))
    reports = _reports(paths, ds, params, partitions, decisions_id)
    written = {p["index"]: (p, paths.dedup_written(ds.index, r["job"])) for r in reports for p in r["parts"]}
    removed_per_part = np.bincount((decisions["row"] >> np.uint64(PART_SHIFT)).astype(np.int64), minlength=len(parts)).tolist()
    if sorted(written) != list(range(len(parts))):
        raise DedupError(f"{merged}: {len(parts)} parts, the stage 4 reports name {len(written)}; rerun the workflow")
    for index, (p, report) in written.items():
        if (p["rows_in"], p["removed"]) != (seen[index]["rows"], removed_per_part[index]) or p["rows_out"] + p["removed"] != p["rows_in"]:
            raise DedupError(
                f"{report}: part {p['name']} read {p['rows_in']} records, wrote {p['rows_out']} and removed {p['removed']}; its merged "
                f"part holds {seen[index]['rows']} and the decisions remove {removed_per_part[index]}: remove it and rerun the workflow"
            )
    first_ordinal = np.cumsum([0] + [seen[i]["rows"] for i in range(len(parts))]).tolist()
    idents = {row: (source, sample) for r in reports for row, source, sample in r["idents"]}

    def ordinal(row: int) -> int:
        return first_ordinal[row >> PART_SHIFT] + (row & _POSITION)

    lines, counted = [], {"exact": 0, "near": 0}
    for row, of, sim, kind in zip(*(decisions[k].tolist() for k in ("row", "of", "sim", "kind"))):
        if row not in idents or of not in idents:
            raise DedupError(
                f"{paths.dedup_work(ds.index)}: no stage 4 report names record {row if row not in idents else of}; rerun the workflow"
            )
        counted[KINDS[kind]] += 1
        me, first = (ordinal(row), *idents[row]), (ordinal(of), *idents[of])
        lines.append(removed_entry(me[0], me, KINDS[kind], first, None if sim != sim else sim))
    out = Path(ds.output_dir) / DEDUP_SUBDIR
    _assemble(Path(ds.output_dir) / DEDUP_STAGING, out, {p["name"]: (p["file"], report) for p, report in written.values()})
    rows_out = sum(p["rows_out"] for p, _ in written.values())
    if rows_out + len(decisions) != rows_in:  # the accounting: every record kept or listed as removed
        raise DedupError(f"{out}: {rows_out} records written + {len(decisions)} removed != {rows_in} read")
    atomic_write_bytes(Path(removed_path), b"".join(lines))
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
        "rows_in": rows_in,
        "exact_duplicates_removed": counted["exact"],
        "near_duplicates_removed": counted["near"],
        "rows_out": rows_out,
        "rows_without_text": sum(p["without_text"] for p in seen.values()),
        "partitions": partitions,
        "seconds": round(time.monotonic() - started, 3),
    }
    atomic_write_json(Path(counts_path), counts)
    return counts


def _merged_rows(cfg: PipelineConfig, ds: DatasetConfig) -> int:
    manifest_path = StateLayout(cfg.state_dir).merge_manifest(ds.index)
    try:
        return json.loads(manifest_path.read_text(encoding="utf-8"))["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DedupError(f"{manifest_path}: cannot read the merge manifest ({type(e).__name__}: {e}); rerun the merge rule") from None


# --------------------------------------------------------------------------- the whole dataset


def dedup_dataset(
    cfg: PipelineConfig, ds: DatasetConfig, params: DedupParams, counts_path: str | Path, removed_path: str | Path, partitions: int = 1
) -> dict:
    """Every stage in this process, one job after the other (the workflow runs them as parallel
    jobs): write ``<output_dir>/deduplicated/``, the removed list and the counts; return the counts."""
    started = time.monotonic()
    _merged_rows(cfg, ds)  # a missing manifest is named before any stage runs
    paths = StateLayout(cfg.state_dir)
    files = [paths.dedup_signatures(ds.index, k) for k in range(partitions)]
    for job in range(partitions):
        write_signatures(merged_dir(ds.output_dir), ds.output_format, params, partitions, job, files[job])
    for partition in range(partitions):
        write_pairs(params, partitions, partition, files, paths.dedup_edges(ds.index, partition))
    write_decisions(cfg, ds, params, partitions)
    for job in range(partitions):
        write_kept(cfg, ds, params, partitions, job)
    return write_deduplicated(cfg, ds, params, partitions, counts_path, removed_path, started)
