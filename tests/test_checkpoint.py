"""The checkpoint and the lease on their own: state files are verified, not trusted; committed
rows are never deleted silently; the lease lives as long as its holder."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import time

import pytest

from mirageflow.shard import checkpoint
from mirageflow.shard.checkpoint import Checkpoint, Lease, ShardBusy
from mirageflow.shard.manifest import MANIFEST_VERSION, CheckpointError, to_ranges
from mirageflow.data.writers import read_parts, write_part
from mirageflow.files import atomic_write_json

FP = "fingerprint-1"


@pytest.fixture(autouse=True)
def _warnings(caplog):
    caplog.set_level(logging.WARNING, logger="mirageflow.shard.checkpoint")


def _ckpt(tmp_path, fmt="parquet", fp=FP) -> Checkpoint:
    return Checkpoint(tmp_path / "state" / "shard_0", fp, {0: (tmp_path / "out" / "shard_0", fmt)})


def _rows(indices) -> list[dict]:
    return [{"source_index": i, "a": f"answer {i}"} for i in indices]


def _error(i: int, kind: str = "json_parse") -> dict:
    return {"dataset": 0, "source_index": i, "stage": "output", "error": kind, "message": f"row {i} failed"}


def _committed(tmp_path, fmt="parquet", parts=3, per_part=100) -> Checkpoint:
    """A shard with ``parts`` committed parts of ``per_part`` rows each."""
    ck = _ckpt(tmp_path, fmt)
    ck.restore(retry_failed=False)
    for p in range(parts):
        ck.commit(0, _rows(range(p * per_part, (p + 1) * per_part)), [])
    return ck


def _out(tmp_path):
    return tmp_path / "out" / "shard_0"


def _state(tmp_path):
    return tmp_path / "state" / "shard_0"


def _parts_on_disk(tmp_path) -> list[str]:
    return sorted(p.name for p in _out(tmp_path).glob("part-*"))


def _output_indices(tmp_path, fmt="parquet") -> list[int]:
    table = read_parts(_out(tmp_path), fmt)
    return sorted(table.column("source_index").to_pylist()) if table is not None else []


# --------------------------------------------------------------------------- 1. parts are verified


def test_the_manifest_records_each_parts_size_checksum_and_rows(tmp_path):
    ck = _ckpt(tmp_path)
    ck.restore(retry_failed=False)
    ck.commit(0, _rows([7, 3, 4, 5, 9]), [_error(6)])
    saved = json.loads(ck.path.read_text())
    assert saved["format"] == MANIFEST_VERSION == 2 and saved["fingerprint"] == FP
    d = saved["datasets"]["0"]
    data = (_out(tmp_path) / "part-00000.parquet").read_bytes()
    assert d["parts"] == [
        {"name": "part-00000.parquet", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "rows": [[3, 6], [7, 8], [9, 10]]}
    ]
    assert d["done"] == [[3, 6], [7, 8], [9, 10]] and d["failed"] == [[6, 7]] and d["fmt"] == "parquet"


@pytest.mark.parametrize("damage", ["truncated", "same_size_flipped_byte", "deleted"])
@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_damaged_newest_part_is_found_at_restore_and_its_rows_recomputed(tmp_path, caplog, damage, fmt):
    _committed(tmp_path, fmt)
    newest = _out(tmp_path) / f"part-00002.{fmt}"
    data = newest.read_bytes()
    if damage == "truncated":  # a kill -9 / full disk mid-write of a file that was renamed anyway
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "same_size_flipped_byte":
        newest.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    else:
        newest.unlink()

    ck = _ckpt(tmp_path, fmt)
    ck.restore(retry_failed=False)
    assert ck.datasets[0].done == set(range(200))  # the 100 rows of the bad part are recomputed
    assert ck.committed_units() == 200
    assert f"part-00002.{fmt}" in caplog.text and "100 row(s)" in caplog.text
    assert _parts_on_disk(tmp_path) == [f"part-00000.{fmt}", f"part-00001.{fmt}"]
    if damage != "deleted":  # moved aside, not deleted
        (aside,) = _state(tmp_path).glob(f"damaged/*/dataset_0/part-00002.{fmt}")
        assert aside.read_bytes() != data and f"moved to {aside.parent}" in caplog.text
    assert [p["name"] for p in json.loads(ck.path.read_text())["datasets"]["0"]["parts"]] == [f"part-00000.{fmt}", f"part-00001.{fmt}"]

    ck.commit(0, _rows(range(200, 300)), [])  # the rerun recomputes them: every row once
    assert _output_indices(tmp_path, fmt) == list(range(300))
    again = _ckpt(tmp_path, fmt)
    again.restore(retry_failed=False)
    assert again.datasets[0].done == set(range(300))


def test_a_damaged_middle_part_does_not_get_its_name_reused_over_a_kept_part(tmp_path, caplog):
    _committed(tmp_path)
    middle = _out(tmp_path) / "part-00001.parquet"
    middle.write_bytes(middle.read_bytes()[:-10])
    ck = _ckpt(tmp_path)
    ck.restore(retry_failed=False)
    assert ck.datasets[0].done == set(range(100)) | set(range(200, 300))
    ck.commit(0, _rows(range(100, 200)), [])
    assert _parts_on_disk(tmp_path) == ["part-00000.parquet", "part-00002.parquet", "part-00003.parquet"]
    assert _output_indices(tmp_path) == list(range(300))


def test_an_old_format_manifest_is_verified_by_reading_its_parts_and_upgraded(tmp_path, caplog):
    out = _out(tmp_path)
    out.mkdir(parents=True)
    for p in range(3):
        write_part(out / f"part-{p:05d}.parquet", _rows(range(p * 10, p * 10 + 10)), "parquet")
    bad = out / "part-00002.parquet"
    bad.write_bytes(bad.read_bytes()[:-30])  # truncated: does not read back
    atomic_write_json(_state(tmp_path) / "checkpoint.json", {
        "fingerprint": FP,
        "datasets": {"0": {"out_dir": str(out), "parts": ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"],
                           "done": [[0, 30]], "failed": [[30, 31]]}},
    })  # fmt: skip
    (_state(tmp_path) / "errors.jsonl").write_text(json.dumps(_error(30)) + "\n")
    ck = _ckpt(tmp_path)
    ck.restore(retry_failed=False)
    assert ck.datasets[0].done == set(range(20)) and ck.datasets[0].failed == {30}
    assert "part-00002.parquet" in caplog.text and "damaged" in caplog.text
    assert list(_state(tmp_path).glob("damaged/*/dataset_0/part-00002.parquet"))
    saved = json.loads(ck.path.read_text())
    assert saved["format"] == 2
    parts = saved["datasets"]["0"]["parts"]
    assert [(p["name"], p["rows"]) for p in parts] == [("part-00000.parquet", [[0, 10]]), ("part-00001.parquet", [[10, 20]])]
    assert parts[0]["sha256"] == hashlib.sha256((out / "part-00000.parquet").read_bytes()).hexdigest()


# --------------------------------------------------------------------------- 2. a damaged manifest


@pytest.mark.parametrize(
    "content",
    [
        os.urandom(64) + b"\xff\xfe",
        b"[]",
        b"{}",
        b'{"fingerprint": "fingerprint-1"}',
        b'{"fingerprint": "fingerprint-1", "datasets": {"0": {"parts": "part-00000.parquet", "done": 3, "failed": []}}}',
        b'{"fingerprint": "fingerprint-1", "datasets": {"0": {"parts": [], "done": [["a", 2]], "failed": []}}}',
        b'{"format": 2, "fingerprint": "fingerprint-1", "datasets": {"0": {"parts": [{"name": "../../etc/passwd"}], "done": [], "failed": []}}}',
        b'{"fingerprint": "fingerprint-1", "datasets": {"0": {"parts": [',
    ],
    ids=["random_bytes", "list", "empty_object", "no_datasets", "wrong_types", "bad_range", "bad_part", "truncated"],
)
def test_a_damaged_manifest_is_set_aside_named_and_its_parts_kept_aside(tmp_path, caplog, content):
    _committed(tmp_path, parts=2)
    ck_path = _state(tmp_path) / "checkpoint.json"
    ck_path.write_bytes(content)
    ck = _ckpt(tmp_path)
    ck.restore(retry_failed=False)
    (aside,) = _state(tmp_path).glob("checkpoint.json.damaged-*")
    assert aside.read_bytes() == content
    assert str(ck_path) in caplog.text and str(aside) in caplog.text
    assert ck.committed_units() == 0  # treated as missing: every row is recomputed...
    (orphans,) = _state(tmp_path).glob("orphaned/*/dataset_0")
    assert sorted(p.name for p in orphans.iterdir()) == ["part-00000.parquet", "part-00001.parquet"]  # ...but nothing deleted
    assert _parts_on_disk(tmp_path) == []
    assert json.loads(ck_path.read_text())["datasets"]["0"]["parts"] == []  # a valid manifest again


def test_a_manifest_from_a_newer_version_is_refused_with_the_file_named(tmp_path):
    _committed(tmp_path, parts=1)
    path = _state(tmp_path) / "checkpoint.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "format": 99}))
    with pytest.raises(CheckpointError, match=rf"{path}.*format 99"):
        _ckpt(tmp_path).restore(retry_failed=False)
    assert _parts_on_disk(tmp_path) == ["part-00000.parquet"]


@pytest.mark.parametrize(
    "line", ['{"dataset": 0, "source_index": 12, "sta', "\udcff-not-utf8", "[1, 2]", '{"dataset": 5, "source_index": 12, "error": "x"}']
)
def test_damaged_error_lines_are_skipped_and_their_rows_recomputed(tmp_path, caplog, line):
    ck = _ckpt(tmp_path)
    ck.restore(retry_failed=False)
    ck.commit(0, _rows(range(10)), [_error(10), _error(11, "json_schema")])
    errors = _state(tmp_path) / "errors.jsonl"
    good = errors.read_bytes()
    raw = line.encode("utf-8", "surrogateescape")
    # a kill -9 mid-append leaves a cut last line, with the manifest already listing the row
    ck.commit(0, [], [_error(12)])
    errors.write_bytes(good + raw + b"\n" if not line.endswith("sta") else good + raw)
    ck = _ckpt(tmp_path)
    ck.restore(retry_failed=False)
    assert f"{errors}:3" in caplog.text
    assert ck.datasets[0].failed == {10, 11}  # row 12 has no readable error line: recomputed
    assert "1 row(s) of dataset 0 listed as failed" in caplog.text
    kept = errors.read_text().splitlines()
    assert [json.loads(x)["source_index"] for x in kept] == [10, 11]  # failed rows == error lines
    assert ck.failed_classes() == {"json_parse": 1, "json_schema": 1}
    assert ck.committed_before(0)(11) and not ck.committed_before(0)(12)


# --------------------------------------------------------------------------- 3. never delete silently


def test_a_deleted_manifest_moves_the_parts_aside_instead_of_deleting_them(tmp_path, caplog):
    _committed(tmp_path)
    (_state(tmp_path) / "checkpoint.json").unlink()
    ck = _ckpt(tmp_path)
    ck.restore(retry_failed=False)
    assert ck.committed_units() == 0 and _parts_on_disk(tmp_path) == []
    (orphans,) = _state(tmp_path).glob("orphaned/*/dataset_0")
    assert len(list(orphans.iterdir())) == 3
    assert f"3 part file(s) in {_out(tmp_path)}" in caplog.text and f"moved to {orphans}" in caplog.text
    ck.commit(0, _rows(range(300)), [])
    assert _output_indices(tmp_path) == list(range(300))


def test_a_part_renamed_into_place_but_never_recorded_is_moved_aside(tmp_path, caplog):
    _committed(tmp_path, parts=2)
    write_part(_out(tmp_path) / "part-00002.parquet", _rows(range(200, 300)), "parquet")  # killed before the manifest
    ck = _ckpt(tmp_path)
    ck.restore(retry_failed=False)
    assert ck.datasets[0].done == set(range(200))
    assert _parts_on_disk(tmp_path) == ["part-00000.parquet", "part-00001.parquet"]
    assert list(_state(tmp_path).glob("orphaned/*/dataset_0/part-00002.parquet"))
    assert "1 part file(s)" in caplog.text


def test_a_changed_fingerprint_still_discards_parts_and_attempts(tmp_path, caplog):
    ck = _committed(tmp_path, parts=2)
    ck.begin_attempt({"attempt": 1})
    ck.save()
    other = _ckpt(tmp_path, fp="fingerprint-2")
    other.restore(retry_failed=False)
    assert "discarding 2 committed part(s)" in caplog.text
    assert other.committed_units() == 0 and other.attempts == [] and _parts_on_disk(tmp_path) == []
    assert not (_state(tmp_path) / "orphaned").exists()


# --------------------------------------------------------------------------- 4. temp files


def test_temp_files_of_killed_writes_are_removed_at_restore(tmp_path):
    _committed(tmp_path, parts=1)
    state, out = _state(tmp_path), _out(tmp_path)
    old = time.time() - 3600
    stale = [
        out / ".part-00001.parquet.k3j2.tmp",
        state / ".checkpoint.json.a1b2.tmp",
        state / ".lease.json.c3d4.tmp",
        state / ".progress.json.e5f6.tmp",
        state / ".status.json.g7h8.tmp",
    ]
    for p in stale:
        p.write_bytes(b"half")
        os.utime(p, (old, old))
    live = state / ".progress.json.live.tmp"  # another thread of this process may be writing it now
    live.write_bytes(b"{")
    _ckpt(tmp_path).restore(retry_failed=False)
    assert [p for p in stale if p.exists()] == []
    assert live.exists()
    assert _parts_on_disk(tmp_path) == ["part-00000.parquet"]


def test_acquiring_the_lease_removes_its_stale_temp_files(tmp_path):
    tmp = tmp_path / ".lease.json.x1y2.tmp"
    tmp.write_bytes(b"{")
    lease = Lease(tmp_path, 30)
    lease.acquire()
    try:
        assert not tmp.exists()
    finally:
        lease.release()


# --------------------------------------------------------------------------- 5. the lease lives as long as its holder


def test_a_live_idle_holder_keeps_its_lease_and_release_frees_it(tmp_path):
    first = Lease(tmp_path, 0.5)  # renewed every 0.125 s
    first.acquire()  # then idle, e.g. loading a model, for several timeouts
    try:
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            with pytest.raises(ShardBusy, match="is being run by"):
                Lease(tmp_path, 0.5).acquire()
            time.sleep(0.15)
        first.check()
    finally:
        first.release()
    assert not (tmp_path / "lease.json").exists()
    second = Lease(tmp_path, 0.4)
    second.acquire()
    second.release()


def test_a_taken_over_lease_stops_renewing_and_check_raises(tmp_path):
    first = Lease(tmp_path, 0.4)
    first.acquire()
    other = {"hostname": "node9", "pid": 4242, "slurm_job_id": "77", "heartbeat": time.time(), "token": "theirs"}
    atomic_write_json(tmp_path / "lease.json", other)
    time.sleep(0.5)  # several heartbeat periods
    assert first.lost is not None and "node9" in first.lost
    assert json.loads((tmp_path / "lease.json").read_text())["hostname"] == "node9"  # not overwritten
    with pytest.raises(ShardBusy, match=rf"lost {tmp_path / 'lease.json'}.*host node9 pid 4242"):
        first.check()
    with pytest.raises(ShardBusy):
        first.heartbeat()
    first.release()
    assert json.loads((tmp_path / "lease.json").read_text())["hostname"] == "node9"  # not ours to delete


def test_check_sees_a_takeover_before_the_heartbeat_thread_does(tmp_path):
    first = Lease(tmp_path, 60)  # a renewal only every 15 s
    first.acquire()
    try:
        first.check()
        first.heartbeat()  # still usable
        atomic_write_json(tmp_path / "lease.json", {"hostname": "node9", "pid": 1, "heartbeat": time.time()})
        with pytest.raises(ShardBusy, match="lost"):
            first.check()
    finally:
        first.release()


def test_heartbeat_io_errors_are_logged_not_fatal(tmp_path, monkeypatch, caplog):
    real = checkpoint.atomic_write_json
    lease = Lease(tmp_path, 0.4)
    lease.acquire()
    try:

        def disk_full(path, obj, **kw):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        monkeypatch.setattr(checkpoint, "atomic_write_json", disk_full)
        time.sleep(0.35)
        assert "cannot renew" in caplog.text and "No space left" in caplog.text
        monkeypatch.setattr(checkpoint, "atomic_write_json", real)
        time.sleep(0.35)
        assert time.time() - json.loads((tmp_path / "lease.json").read_text())["heartbeat"] < 0.4  # renewing again
        assert lease.lost is None
        lease.check()
    finally:
        lease.release()


def test_a_damaged_lease_names_the_file_and_is_taken_over_once_stale(tmp_path, caplog):
    path = tmp_path / "lease.json"
    path.write_bytes(b"\x00\xff garbage")
    with pytest.raises(ShardBusy, match=rf"{path} is damaged.*delete it"):
        Lease(tmp_path, 300).acquire()
    path.write_text('{"hostname": "n1"}')  # JSON, but not a lease
    with pytest.raises(ShardBusy, match=rf"{path} is damaged"):
        Lease(tmp_path, 300).acquire()
    old = time.time() - 600
    os.utime(path, (old, old))
    lease = Lease(tmp_path, 300)
    lease.acquire()
    try:
        assert lease.held() and f"taking over {path}: it is damaged" in caplog.text
    finally:
        lease.release()


# --------------------------------------------------------------------------- 6. attempts


def test_attempts_round_trip_through_the_manifest(tmp_path):
    ck = _ckpt(tmp_path)
    ck.restore(retry_failed=False)
    assert ck.attempts == []
    i = ck.begin_attempt({"attempt": 1, "started_at": "2024-01-01T00:00:00Z"})
    assert i == 0
    ck.commit(0, _rows(range(5)), [])  # every save carries them
    assert json.loads(ck.path.read_text())["attempts"] == [{"attempt": 1, "started_at": "2024-01-01T00:00:00Z"}]
    ck.update_attempt(0, {"attempt": 1, "status": "failed", "rows_computed": 5})
    assert ck.begin_attempt({"attempt": 2}) == 1
    ck.save()
    again = _ckpt(tmp_path)
    again.restore(retry_failed=False)
    assert again.attempts == [{"attempt": 1, "status": "failed", "rows_computed": 5}, {"attempt": 2}]
    assert again.datasets[0].done == set(range(5))
    again.attempts[1]["outcome"] = "killed"  # changed in place, as the runner does: saved too
    again.save()
    third = _ckpt(tmp_path)
    third.restore(retry_failed=False)
    assert third.attempts[1] == {"attempt": 2, "outcome": "killed"}


def test_ranges_helpers_still_agree():
    assert to_ranges({1, 2, 3, 7}) == [[1, 4], [7, 8]]


def test_a_manifest_of_a_config_with_another_dataset_list_is_discarded_not_called_damaged(tmp_path, caplog):
    two = Checkpoint(_state(tmp_path), FP, {0: (_out(tmp_path), "parquet"), 1: (tmp_path / "out1" / "shard_0", "parquet")})
    two.restore(retry_failed=False)
    two.commit(0, _rows(range(3)), [])
    two.commit(1, _rows(range(3)), [])
    one = _ckpt(tmp_path, fp="fingerprint-2")
    one.restore(retry_failed=False)
    assert "discarding 2 committed part(s)" in caplog.text and "damaged" not in caplog.text
    assert not list(_state(tmp_path).glob("checkpoint.json.damaged-*")) and _parts_on_disk(tmp_path) == []
