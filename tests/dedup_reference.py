"""The single-job deduplication as it was before the stages (data/dedup_stages.py): a record at
a time, in merged order, against a MinHashLSH index of the kept records. Kept here, in the
tests only, as the reference the staged jobs must agree with (tests/test_dedup.py)."""

from __future__ import annotations

import hashlib
import zlib
from typing import Any

from mirageflow.config.types import DedupParams
from mirageflow.data.dedup import LSH_WEIGHTS, MINHASH_SEED, DedupError, normalize, shingles
from mirageflow.data.writers import jsonl_line


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


def reference(records: list, params: DedupParams) -> tuple[list[bool], list[bytes], dict]:
    """Records in merged order -> (kept or not, removed list lines, counts) as the single job
    decided them."""
    dedup, counter = Deduplicator(params), _Counter()
    keep = [counter.decide(dedup, counter.rows_in, r, params.text_field) for r in records]
    counts = {"exact": counter.exact, "near": counter.near, "rows_without_text": counter.rows_without_text}
    return keep, counter.removed, counts
