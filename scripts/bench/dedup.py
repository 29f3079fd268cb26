"""Deduplication after merge (mirageflow/data/dedup.py): speed, and what it finds.

    python scripts/bench/dedup.py                  # ~1-2 min
    python scripts/bench/dedup.py --rows 50000 --repeats 3

Synthetic records (``make_rows``: 30-60 words each): originals, plus exact copies (other
case and spacing) and near copies (one word of the text replaced: true Jaccard of 5-char
shingles ~0.8-0.95) of random earlier originals, shuffled in. The merged output is written
as JSONL and Parquet (2 parts each) and deduplicated with the defaults (exact + fuzzy,
threshold 0.85, 128 permutations, 5-char shingles) and with exact only. Pinned to one CPU,
interleaved repeats, medians. Found = injected copies removed; near copies below the
threshold by their true Jaccard are counted apart (their removal is not expected);
originals removed must be 0 (an original that is itself a near duplicate of another by
chance would count there).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

from mirageflow.config.types import DedupParams
from mirageflow.data.dedup import normalize, shingles
from mirageflow.data.dedup_stages import dedup_dataset
from mirageflow.data.writers import records_table, write_merged


def jaccard(a: str, b: str) -> float:
    x, y = shingles(normalize(a), 5), shingles(normalize(b), 5)
    return len(x & y) / len(x | y)


def make_records(n: int, seed: int) -> tuple[list[dict], dict]:
    """n records: 80% originals, 10% exact copies, 10% near copies; and what was injected."""
    rng = random.Random(seed)
    originals = C.make_rows(int(n * 0.8), seed=seed)
    keyed, kinds = [], {}
    for j, r in enumerate(originals):
        keyed.append((float(j), {"id": r["id"], "text": r["text"], "meta": r["meta"]}))
        kinds[r["id"]] = ("original", None)
    for i in range(n - len(originals)):
        j = rng.randrange(len(originals))
        src = originals[j]
        if i % 2 == 0:
            text = "  " + src["text"].upper().replace(" ", "  ") + "\n"
            kinds[f"copy-{i}"] = ("exact", None)
        else:
            words = src["text"].split()
            words[rng.randrange(len(words))] = "zebra"
            text = " ".join(words)
            kinds[f"copy-{i}"] = ("near", jaccard(text, src["text"]))
        # somewhere after its original, so the original is the one kept
        keyed.append((rng.uniform(j + 0.5, len(originals)), {"id": f"copy-{i}", "text": text, "meta": src["meta"]}))
    records = [r for _, r in sorted(keyed, key=lambda kv: kv[0])]
    for k, r in enumerate(records):
        r["source_index"] = k
    return records, kinds


def write_dataset(root: Path, fmt: str, records: list[dict]) -> None:
    half = len(records) // 2
    halves = [records[:half], records[half:]]
    if fmt == "jsonl":
        items = [[(json.dumps(r, ensure_ascii=False) + "\n").encode() for r in h] for h in halves]
    else:
        items = [records_table(h) for h in halves]
    write_merged(items, root / "out" / "merged", fmt)
    (root / "state" / "merged").mkdir(parents=True, exist_ok=True)
    (root / "state" / "merged" / "dataset_0.json").write_text(json.dumps({"rows": len(records)}))


def run_once(root: Path, fmt: str, params: DedupParams) -> dict:
    cfg = SimpleNamespace(state_dir=str(root / "state"))
    ds = SimpleNamespace(index=0, path="synthetic", output_dir=str(root / "out"), output_format=fmt)
    t0, c0 = time.perf_counter(), time.process_time()
    counts = dedup_dataset(cfg, ds, params, root / "state/dedup/dataset_0.json", root / "state/dedup/dataset_0.removed.jsonl")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    removed = [json.loads(x) for x in (root / "state/dedup/dataset_0.removed.jsonl").read_text().splitlines()]
    shutil.rmtree(root / "out" / "deduplicated")
    return {"wall": wall, "cpu": cpu, "counts": counts, "removed": removed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = ap.parse_args()
    cmd = (
        "python scripts/bench/dedup.py"
        + ("" if args.rows == 20000 else f" --rows {args.rows}")
        + ("" if args.repeats == 3 else f" --repeats {args.repeats}")
    )
    info = C.machine("mirageflow", "datasketch", "pyarrow", "numpy")
    pinned = C.pin_to_one_core()
    records, kinds = make_records(args.rows, seed=0)
    by_index = {r["source_index"]: r["id"] for r in records}
    variants = {
        "exact+fuzzy": DedupParams(True, True, True, "text", 0.85, 128, 5),
        "exact only": DedupParams(True, True, False, "text", 0.85, 128, 5),
    }
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        roots = {}
        for fmt in ("jsonl", "parquet"):
            roots[fmt] = Path(tmp) / fmt
            write_dataset(roots[fmt], fmt, records)
        for _ in range(args.repeats):
            for fmt, root in roots.items():
                for name, params in variants.items():
                    results.setdefault((fmt, name), []).append(run_once(root, fmt, params))
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    injected_near = [k for k, (kind, _) in kinds.items() if kind == "near"]
    n_exact = sum(1 for kind, _ in kinds.values() if kind == "exact")
    near_above = [k for k in injected_near if kinds[k][1] >= 0.85]
    rows, figures = [], {}
    for (fmt, name), rs in results.items():
        wall = C.median([r["wall"] for r in rs])
        cpu = C.median([r["cpu"] for r in rs])
        removed_ids = {by_index[x["source_index"]]: x for x in rs[0]["removed"]}
        originals_removed = sum(1 for k in removed_ids if kinds[k][0] == "original")
        exact_found = sum(1 for k, (kind, _) in kinds.items() if kind == "exact" and k in removed_ids)
        near_found = sum(1 for k in near_above if k in removed_ids)
        below_removed = sum(1 for k in injected_near if k not in near_above and k in removed_ids)
        rows.append([fmt, name, C.fmt(args.rows / wall), C.fmt(args.rows / cpu), rs[0]["counts"]["exact_duplicates_removed"],
                     rs[0]["counts"]["near_duplicates_removed"], f"{exact_found}/{n_exact}",
                     f"{near_found}/{len(near_above)}", f"{below_removed}/{len(injected_near) - len(near_above)}", originals_removed])  # fmt: skip
        key = f"{fmt}_{name.replace('+', '_').replace(' ', '_')}"
        figures[f"rows_per_sec_{key}"] = args.rows / wall
        if name == "exact+fuzzy":
            figures[f"near_recall_above_threshold_{fmt}"] = near_found / max(len(near_above), 1)
            figures[f"originals_removed_{fmt}"] = originals_removed
    figures["peak_rss_mb"] = rss_mb

    body = f"""## Deduplication after merge (`scripts/bench/dedup.py`)

- command: `{cmd}`
- date: {C.now()}; mirageflow at {C.git_rev()}
{C.machine_lines(info)}
{args.rows:,} synthetic records (30-60 words): 80% originals, 10% exact copies (other case
and spacing), 10% near copies (one word replaced; {len(near_above)} of {len(injected_near)} at a true
5-shingle Jaccard >= 0.85 to their original), each after its original. Merged output in 2
parts; `dedup_dataset` end to end (the stages in one process, one job each: read, decide, write deduplicated/, removed list,
counts); {pinned}, {args.repeats} interleaved repeats, median. Found: injected copies removed
(near: those at or above the threshold; "below" counts near copies under it that were
removed anyway, by their MinHash estimate). Peak RSS is the whole benchmark process.

{C.table(["format", "passes", "rows/s", "rows per CPU-second", "exact removed", "near removed", "exact found", "near found", "below removed", "originals removed"], rows)}

Figures:

```
{chr(10).join(f"{k}: {v:.3f}" if isinstance(v, float) and v < 10 else f"{k}: {v:.0f}" for k, v in figures.items())}
```
"""
    if not args.no_write:
        C.write_section("dedup", body)
    C.print_figures(figures)


if __name__ == "__main__":
    main()
