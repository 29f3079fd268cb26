"""Live progress: windowed rates, ETA, atomic progress.json, and the runner's hooks."""

from __future__ import annotations

import json
import os
import time

import pytest

from mirageflow.shard.progress import ProgressReporter, RateWindow, check_progress, read_progress

from fakes.configs import PLAIN, shard_config
from fakes.engines import ScriptedEngine


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_rates_cover_the_last_window_not_the_lifetime():
    w = RateWindow(window=180)
    rows = tokens = 0
    for t in range(0, 401, 5):
        w.add(float(t), rows, tokens)
        step = 50 if t < 200 else 5  # 10 rows/s for 200 s, then 1 row/s
        rows += step
        tokens += step * 20
    rows_per_sec, tokens_per_sec, covered = w.rates()
    assert rows_per_sec == pytest.approx(1.0, abs=0.05)  # lifetime would say ~5.5
    assert tokens_per_sec == pytest.approx(20.0, abs=1.0)
    assert 180 <= covered <= 185


def test_rates_need_a_second_of_history():
    w = RateWindow()
    assert w.rates() == (None, None, 0.0)
    w.add(0.0, 0, 0)
    w.add(0.5, 10, 10)
    assert w.rates()[0] is None


def test_state_has_phase_rows_rates_eta_and_who(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    clock = Clock()
    snap = {"rows_done": 100, "rows_failed": 2, "output_tokens": 1000, "queue_depth": 17, "inflight": 64}
    rep = ProgressReporter(tmp_path / "progress.json", 3, 1100, lambda: dict(snap), attempt=2, num_gpus=4, clock=clock)
    rep.set_phase("loading")
    clock.now = 30.0
    rep.set_phase("generating")  # rates start here (rows 100 were resumed)
    clock.now = 130.0
    snap.update(rows_done=600, output_tokens=51_000)
    rep.write()
    state = json.loads((tmp_path / "progress.json").read_text())
    assert state["phase"] == "generating" and state["phase_seconds"] == pytest.approx(100.0)
    assert (state["rows_done"], state["rows_total"], state["rows_failed"]) == (600, 1100, 2)
    assert state["fraction_done"] == pytest.approx(600 / 1100)
    assert state["rows_per_sec"] == pytest.approx(5.0) and state["tokens_per_sec"] == pytest.approx(500.0)
    assert state["eta_seconds"] == pytest.approx(100.0) and state["eta_human"] == "00:01:40"
    assert (state["queue_depth"], state["inflight"], state["num_gpus"], state["attempt"]) == (17, 64, 4, 2)
    assert state["hostname"] and state["pid"] == os.getpid() and state["slurm_job_id"] == "4242"
    assert state["updated_at"].endswith("+00:00") and state["elapsed_seconds"] == pytest.approx(130.0)
    rep.finish("done")
    state = json.loads((tmp_path / "progress.json").read_text())
    assert state["phase"] == "done" and state["eta_seconds"] == 0
    assert [p.name for p in tmp_path.iterdir()] == ["progress.json"]  # atomic: no temp files left


def test_no_rate_and_no_eta_while_nothing_finished_and_samples_apart_from_rows(tmp_path):
    """A batch in flight finishes nothing for a while: no "0.00 rows/s", no ETA, and the reason;
    finished samples move the figures before any commit (committed ones are counted apart)."""
    clock = Clock()
    snap = {"samples_done": 0, "rows_done": 0, "samples_committed": 0, "output_tokens": 0, "inflight": 12}
    rep = ProgressReporter(tmp_path / "progress.json", 0, 12, lambda: dict(snap), n_samples=2, clock=clock)
    rep.set_phase("generating")
    clock.now = 30.0
    rep.write()
    state = json.loads((tmp_path / "progress.json").read_text())
    assert state["rows_per_sec"] is None and state["samples_per_sec"] is None and state["eta_seconds"] is None
    assert state["eta_note"] == "nothing finished in the last 30 s (12 in flight)"
    assert (state["samples_total"], state["rows_total"], state["fraction_done"]) == (24, 12, 0.0)
    clock.now = 40.0
    snap.update(samples_done=8, rows_done=4, samples_committed=0, output_tokens=80, inflight=4)  # finished, not committed yet
    rep.write()
    state = json.loads((tmp_path / "progress.json").read_text())
    assert (state["samples_done"], state["rows_done"], state["samples_committed"]) == (8, 4, 0)
    assert state["samples_per_sec"] == pytest.approx(0.2) and state["rows_per_sec"] == pytest.approx(0.1)
    assert state["eta_seconds"] == pytest.approx(80.0) and state["eta_note"] is None  # 16 samples left at 0.2/s
    assert state["fraction_done"] == pytest.approx(8 / 24)
    snap.update(samples_done=99, rows_done=50)  # whatever a snapshot says, never more than the shard has
    rep.write()
    state = json.loads((tmp_path / "progress.json").read_text())
    assert (state["samples_done"], state["rows_done"], state["fraction_done"]) == (24, 12, 1.0)


def test_thread_rewrites_the_file_every_interval(tmp_path):
    count = {"n": 0}

    def snapshot():
        count["n"] += 1
        return {"rows_done": count["n"]}

    rep = ProgressReporter(tmp_path / "progress.json", 0, 100, snapshot, interval=0.05)
    rep.start()
    time.sleep(0.3)
    rep.finish("done")
    assert count["n"] >= 4
    assert json.loads((tmp_path / "progress.json").read_text())["rows_done"] == count["n"]


def test_a_failing_snapshot_or_disk_never_raises(tmp_path):
    def broken():
        raise RuntimeError("dictionary changed size during iteration")

    rep = ProgressReporter(tmp_path / "progress.json", 0, 10, broken)
    rep.write()
    assert json.loads((tmp_path / "progress.json").read_text())["rows_done"] is None
    (tmp_path / "a_file").write_text("")
    rep = ProgressReporter(tmp_path / "a_file" / "progress.json", 0, 10, lambda: {})
    rep.write()  # cannot create the directory: logged, not raised
    assert rep._failed_writes == 1


def test_what_the_reporter_writes_passes_its_readers_check(tmp_path):
    """check_progress (used by `mmirage status` and the report) accepts every state() the reporter writes."""
    clock = Clock()
    rep = ProgressReporter(tmp_path / "progress.json", 0, 10, lambda: {"rows_done": 3, "output_tokens": 7}, attempt=1, clock=clock)
    for phase in ("starting", "loading", "generating", "done"):
        rep.set_phase(phase)
        clock.now += 2.0
        rep.write()
        progress, why = read_progress(tmp_path / "progress.json")
        assert why is None and progress["phase"] == phase
    assert read_progress(tmp_path / "missing.json") == (None, None)


@pytest.mark.parametrize(
    "content, why",
    [
        (b"[]", "a JSON array, not an object"),
        (b"{}", "phase is missing, not a string"),
        (b"\x00\xff\xfe garbage", "not JSON"),
        (b"", "empty file"),
        (b'{"phase": "generating", "updated_at_unix": "now"}', 'updated_at_unix is "now", not a number'),
        (b'{"phase": "generating", "fraction_done": true}', "fraction_done is true, not a number"),
        (b'{"phase": "generating", "hostname": 7}', "hostname is 7, not a string"),
        (b'{"phase": "generating", "eta_seconds": NaN}', "eta_seconds is NaN, not a finite number"),
    ],
)
def test_a_damaged_progress_json_says_why(tmp_path, content, why):
    path = tmp_path / "progress.json"
    path.write_bytes(content)
    progress, reason = read_progress(path)
    assert progress is None and reason.startswith(why)
    assert check_progress({"phase": "done", "rows_done": None}) is None


# --------------------------------------------------------------------------- in the shard runner


class QueueEngine(ScriptedEngine):
    """Looks at progress.json while generating; reports a queue depth."""

    seen: list = []

    def queue_depth(self):
        return 7

    async def generate_one(self, r):
        path = self.shard_dir / "progress.json"
        self.seen.append(json.loads(path.read_text()))
        return await super().generate_one(r)


def test_runner_writes_progress_through_the_phases(tmp_path):
    cfg = shard_config(tmp_path, [{"q": f"r{i}"} for i in range(5)], PLAIN)
    engine = QueueEngine(lambda p: "a b")
    engine.shard_dir = cfg.shard_dir(0)
    engine.seen = []
    from mirageflow.shard.runner import run_shard

    run_shard(cfg, 0, attempt=3, engine_factory=lambda p, b, **kw: engine)
    mid = engine.seen[0]
    # the shard's own attempt number (its first); Snakemake's retry number 3 is kept beside it
    assert mid["phase"] == "generating" and mid["rows_total"] == 5 and mid["queue_depth"] == 7 and mid["attempt"] == 1
    status = json.loads((cfg.shard_dir(0) / "status.json").read_text())
    assert status["attempt"] == 1 and [(a["attempt"], a["snakemake_attempt"]) for a in status["stats"]["attempts"]] == [(1, 3)]
    final = json.loads((cfg.shard_dir(0) / "progress.json").read_text())
    assert final["phase"] == "done" and final["rows_done"] == 5 and final["fraction_done"] == 1.0
    assert final["output_tokens"] == 10


def test_runner_marks_progress_failed(tmp_path):
    from mirageflow.shard import ShardFailed
    from mirageflow.shard.runner import run_shard

    cfg = shard_config(
        tmp_path, [{"q": "a"}, {"q": "b"}], [{"name": "a", "output_type": "JSON", "prompt": "{{ q }}", "output_schema": ["x"]}]
    )
    with pytest.raises(ShardFailed):
        run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda p: "not json"))
    assert json.loads((cfg.shard_dir(0) / "progress.json").read_text())["phase"] == "failed"


# --------------------------------------------------------------------------- history (report.html's throughput over time)


def test_history_keeps_the_whole_attempt_in_a_bounded_number_of_samples():
    from mirageflow.shard.progress import History

    h = History(limit=20)
    for i in range(5000):
        h.add(i * 5.0, i, 10 * i)
        assert len(h.samples) <= 21
    t = [s[0] for s in h.samples]
    assert t[0] == 0.0 and t[-1] == 4999 * 5.0  # from the start to the newest write
    assert t == sorted(t) and len(set(t)) == len(t)
    assert len(h.samples) >= 10
    gaps = [b - a for a, b in zip(t, t[1:-1])]
    assert max(gaps) == min(gaps)  # evenly thinned (the newest sample aside)
    assert all(s[1] * 10 == s[2] for s in h.samples)


def test_progress_json_has_a_history_of_rows_and_tokens(tmp_path):
    clock = Clock()
    snap = {"rows_done": 0, "output_tokens": 0}
    rep = ProgressReporter(tmp_path / "progress.json", 0, 100, lambda: dict(snap), clock=clock)
    rep.set_phase("generating")
    for i in range(1, 4):
        clock.now = 5.0 * i
        snap.update(rows_done=10 * i, output_tokens=100 * i)
        rep.write()
    state, why = read_progress(tmp_path / "progress.json")
    assert why is None
    assert state["history"][-3:] == [[5.0, 10, 100], [10.0, 20, 200], [15.0, 30, 300]]
    assert check_progress({**state, "history": [[1, 2]]}) == "history is not a list of [seconds, rows, tokens] samples"
    assert check_progress({**state, "history": "x"}) is not None


def test_tokens_of_a_sample_just_after_generation_began_are_drawn(tmp_path):
    """A sample taken 0.03 s after generation began (a tiny model's first batch done) must not
    read as taken before it: history's time resolution (0.1 s) once rounded it down to before
    the start, and the report's windows lost that batch's tokens (test_workflow_e2e, under load)."""
    from mirageflow.report.html import work_windows

    clock = Clock()
    snap = {"rows_done": 0, "output_tokens": 0}
    rep = ProgressReporter(tmp_path / "progress.json", 0, 8, lambda: dict(snap), clock=clock)
    clock.now = 10.21
    rep.set_phase("generating")
    clock.now = 10.24
    snap.update(rows_done=4, output_tokens=16)
    rep.write()
    clock.now = 15.0
    snap.update(rows_done=8, output_tokens=32)
    rep.write()
    state, _ = read_progress(tmp_path / "progress.json")
    windows = work_windows(state["history"], state["generation_started_seconds"])
    assert sum(grown for _, _, grown in windows) == 32
