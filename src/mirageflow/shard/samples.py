"""Several samples per row (``processing_params.n_samples``): units, seeds, order (the units
still to do are read by shard/feed.py).

With n samples per row the unit of work, of the checkpoint and of the accounting is a
sample, numbered ``unit = source_index * n + sample_index``. With n = 1 a unit is the
source index itself, so records, checkpoints and errors are exactly as without samples.

- Order: units sort as the records must appear, x x x y y y (row, then sample).
- Resume: the checkpoint's done/failed sets, part row ranges and error lines are unit
  numbers. A sample is finished when it is committed (in a part file, or as an error line);
  a rerun skips committed units, so a killed run redoes no finished sample and duplicates
  none; a row is read again only while one of its samples is not committed. Changing
  n_samples changes the records' fingerprint: the shard starts over.
- Records carry ``source_index`` and ``sample_index``; error lines too (``sample_index``
  only with n > 1).
- Seeds: each (dataset, row) has a seed, a hash of the base seed (``sampling_params.seed``,
  else ``DEFAULT_BASE_SEED``), the dataset's position in the config and the source index;
  sample k's seed is that plus k. The same on every rerun and for any num_shards, and the
  samples of one row never share a seed. Requests are seeded when n > 1 or when
  ``sampling_params.seed`` is set.
- Requests: every sample is its own chain of outputs (a later output's prompt uses the
  earlier outputs of the same sample). The first LLM output, when only filters come before
  it, is asked once per row for all its pending samples (``Engine.generate_samples``): an
  engine with native ``n`` (the openai backend) gets one request with ``n`` and the seed of
  the first sample; the others get one request per sample. Consecutive seeds make the two
  the same draw where the server seeds choice i with seed + i (vLLM); a row whose pending
  samples are not consecutive (a resume) is sent as one request per run of them.
"""

from __future__ import annotations

import hashlib

DEFAULT_BASE_SEED = 0
SEED_MODULUS = 2**31  # fits every backend's seed (SGLang, OpenAI-compatible servers, torch)


# n_samples' schema maximum: sample seeds of a row are row_seed .. row_seed + n - 1
MAX_SAMPLES = 65536


def row_seed(base: int | None, dataset: int, source_index: int) -> int:
    """The seed of a row's first sample: stable across reruns, shard counts and machines."""
    material = f"{DEFAULT_BASE_SEED if base is None else base}:{dataset}:{source_index}:0".encode()
    return int.from_bytes(hashlib.sha256(material).digest()[:8], "big") % SEED_MODULUS


def sample_seed(base: int | None, dataset: int, source_index: int, sample_index: int) -> int:
    """The seed of one sample: the row's seed + the sample index (below 2**31 + MAX_SAMPLES,
    an int64 for every backend), so one request with ``n`` and that row's first pending seed
    covers the next samples on servers that seed choice i with seed + i."""
    return row_seed(base, dataset, source_index) + sample_index


def runs(sample_indexes: list[int]) -> list[list[int]]:
    """Sample indexes (ascending) as runs of consecutive ones: [0, 1, 3] -> [[0, 1], [3]]."""
    out: list[list[int]] = []
    for k in sample_indexes:
        if out and out[-1][-1] == k - 1:
            out[-1].append(k)
        else:
            out.append([k])
    return out


def unit(source_index: int, sample_index: int | None, n: int) -> int:
    return source_index if n == 1 else source_index * n + sample_index


def record_unit(record: dict, n: int) -> int:
    """The unit of a record or an error entry (``source_index``, ``sample_index``)."""
    return record["source_index"] if n == 1 else record["source_index"] * n + record["sample_index"]


def describe(units: list[list[int]], n: int) -> str:
    """Unit ranges as the rows and samples they are, for messages."""
    if n == 1:
        return str(units)
    return str([f"row {a // n} sample {a % n}" + ("" if b == a + 1 else f" .. row {(b - 1) // n} sample {(b - 1) % n}") for a, b in units])


def describe_count(units: int, n: int, rows: int | None = None) -> str:
    """A count of finished units as the rows and samples it is: "8 rows"; with n > 1
    "16 samples (8 rows complete)" (``rows``: the rows whose every sample is among them)."""
    if n == 1:
        return f"{units:,} row" + ("" if units == 1 else "s")
    text = f"{units:,} sample" + ("" if units == 1 else "s")
    return text + (f" ({rows:,} row{'' if rows == 1 else 's'} complete)" if rows is not None else "")


def complete_rows(ranges: list[list[int]], n: int) -> int:
    """Rows all of whose n units lie in ``ranges`` (sorted, disjoint [start, stop) unit ranges)."""
    if n == 1:
        return sum(b - a for a, b in ranges)
    return sum(max(0, b // n - -(-a // n)) for a, b in ranges)
