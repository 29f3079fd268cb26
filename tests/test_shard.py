"""The shard runner with a scripted engine: per-row errors, JSON validation, status and stats."""

from __future__ import annotations

import json

import pytest
from fakes.configs import PLAIN, shard_config
from fakes.engines import EngineCrash, ScriptedEngine
from fakes.runs import row_errors

from mirageflow.config import load_config
from mirageflow.data.writers import read_parts
from mirageflow.files import atomic_write_json
from mirageflow.engines.wire import Completion
from mirageflow.shard import ShardFailed
from mirageflow.shard.runner import index_datasets, run_shard


JSON_OUTPUT = {"name": "a", "output_type": "JSON", "prompt": "{{ q }}", "output_schema": {"n": {"type": "int", "min": 0, "max": 9}}}


def test_json_outputs_are_validated_and_bad_ones_become_row_errors(tmp_path):
    answers = {"ok": '{"n": 3}', "fenced": '```json\n{"n": 4}\n```', "big": '{"n": 12}', "word": "three", "cut": '{"n": '}
    cfg = shard_config(tmp_path, [{"q": q} for q in answers], [JSON_OUTPUT])

    def answer(prompt):
        key = prompt.split(":", 1)[1]
        if key == "cut":
            return Completion(0, answers[key], 5, 7, "length")
        return answers[key]

    status = run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(answer))
    records = read_parts(tmp_path / "out" / "shard_0", "parquet").to_pylist()
    assert records == [{"q": "ok", "a": {"n": 3}, "source_index": 0}, {"q": "fenced", "a": {"n": 4}, "source_index": 1}]
    errors = {e["source_index"]: e for e in row_errors(cfg)}
    assert errors[2]["error"] == "json_schema" and "12 is greater than the maximum of 9" in errors[2]["message"]
    assert errors[3]["error"] == "json_parse" and errors[3]["raw"] == "three"
    assert errors[4]["error"] == "json_truncated"
    st = status["stats"]
    assert (st["rows_processed"], st["rows_failed"]) == (2, 3)
    assert st["rows_failed_by_class"] == {"json_schema": 1, "json_parse": 1, "json_truncated": 1}
    assert st["output_tokens"] == 2 + 4 + 2 + 1 + 7  # whitespace words; the cut answer reports 7 and st["requests"] == 5


def test_later_outputs_see_earlier_ones_and_system_prompts(tmp_path):
    outputs = [
        {"name": "a", "prompt": "first {{ q }}", "system": "be brief"},
        {"name": "b", "prompt": "second {{ a }}"},
    ]
    cfg = shard_config(tmp_path, [{"q": "x"}], outputs, {"b": "{{ b }}"})
    engine = ScriptedEngine(lambda p: p.rsplit(":", 1)[1].upper())
    run_shard(cfg, 0, engine_factory=lambda p, b, **kw: engine)
    assert engine.prompts == ["system:be brief|user:first x", "user:second FIRST X"]
    assert read_parts(tmp_path / "out" / "shard_0", "parquet").to_pylist() == [{"b": "SECOND FIRST X", "source_index": 0}]
    assert engine.closed


def test_generation_errors_are_row_errors(tmp_path):
    cfg = shard_config(tmp_path, [{"q": "long"}, {"q": "fine"}], [{"name": "a", "prompt": "{{ q }}"}])

    def answer(prompt):
        if "long" in prompt:
            return Completion(0, "", 900, 0, "abort", "context_length", "prompt has 900 tokens")
        return "ok"

    status = run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(answer))
    assert [e["error"] for e in row_errors(cfg)] == ["context_length"]
    assert status["stats"]["rows_processed"] == 1


def test_a_shard_where_every_row_fails_fails_loudly(tmp_path):
    cfg = shard_config(tmp_path, [{"q": "a"}, {"other": 1}, "[1, 2]"], [JSON_OUTPUT])
    engine = ScriptedEngine(lambda p: "not json")
    with pytest.raises(ShardFailed, match=r"every row of shard 0: 3 of 3 rows failed \(.*json_parse: 1"):
        run_shard(cfg, 0, engine_factory=lambda p, b, **kw: engine)
    assert engine.closed
    assert not (cfg.shard_dir(0) / "status.json").exists()
    failure = json.loads((cfg.shard_dir(0) / "failure.json").read_text())
    assert failure["status"] == "failed" and "every row" in failure["error"]
    assert sorted(e["error"] for e in row_errors(cfg)) == ["bad_row", "json_parse", "missing_variable"]


def test_empty_shard_succeeds_with_zero_rows(tmp_path):
    cfg = shard_config(tmp_path, [{"q": "only"}], [{"name": "a", "prompt": "{{ q }}"}], num_shards=2)
    status = run_shard(cfg, 1, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda p: "x"))
    assert status["stats"]["rows_processed"] == 0 and status["datasets"][0]["row_range"] == [1, 1]


class GatedEngine(ScriptedEngine):
    """Holds every request until ``max_inflight`` are waiting, then answers the oldest one
    (all of them once ``total`` requests came): the runner must keep the window full,
    across datasets too, or the shard never ends."""

    max_inflight = 4

    def __init__(self, total: int):
        super().__init__(lambda p: "x")
        self.total, self.submitted = total, 0
        self.waiting: list = []
        self.inflight_prompts: list[list[str]] = []

    async def generate_one(self, r):
        import asyncio

        future = asyncio.get_running_loop().create_future()
        self.waiting.append((r.prompt, future))
        self.submitted += 1
        if len(self.waiting) == self.max_inflight:
            self.inflight_prompts.append([p for p, _ in self.waiting])
            self.waiting.pop(0)[1].set_result(None)
        if self.submitted == self.total:
            while self.waiting:
                self.waiting.pop(0)[1].set_result(None)
        await asyncio.wait_for(future, 10)
        return Completion(r.id, "x", 1, 1, "stop")


def test_the_window_stays_full_from_one_dataset_into_the_next(tmp_path):
    cfg = shard_config(tmp_path, [{"q": f"a{i}"} for i in range(6)], PLAIN)
    second = tmp_path / "second.jsonl"
    second.write_text("".join(json.dumps({"q": f"b{i}"}) + "\n" for i in range(6)))
    raw = json.loads(json.dumps(cfg.raw))
    raw["loading_params"]["datasets"].append({"path": str(second), "type": "JSONL", "output_dir": str(tmp_path / "out2")})
    cfg = load_config(raw)
    index_datasets(cfg)
    engine = GatedEngine(total=12)
    status = run_shard(cfg, 0, engine_factory=lambda p, b, **kw: engine)
    assert status["stats"]["rows_processed"] == 12
    # every time the engine answered, 4 rows were in flight; some of those mixed the datasets
    assert all(len(w) == 4 for w in engine.inflight_prompts)
    assert any({p.split(":")[-1][0] for p in w} == {"a", "b"} for w in engine.inflight_prompts)


# --------------------------------------------------------------------------- checkpoints and resume


def _crash_after(n: int):
    calls = {"n": 0}

    def answer(prompt):
        calls["n"] += 1
        if calls["n"] > n:
            raise EngineCrash("engine died")
        return "ans " + prompt.rsplit(":", 1)[1]

    return answer


def _records(tmp_path):
    table = read_parts(tmp_path / "out" / "shard_0", "parquet")
    return sorted(table.to_pylist(), key=lambda r: r["source_index"])


def test_a_rerun_resumes_from_the_last_commit_without_redoing_rows(tmp_path):
    rows = [{"q": f"r{i}"} for i in range(9)]
    cfg = shard_config(tmp_path, rows, PLAIN)
    with pytest.raises(ShardFailed, match="engine 'llm' failed on row .*: EngineCrash: engine died"):
        run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(_crash_after(5)))
    committed = {r["source_index"] for r in _records(tmp_path)}
    assert len(committed) >= 4  # commits every 2 rows; a crash loses at most one interval
    assert json.loads((cfg.shard_dir(0) / "failure.json").read_text())["error"].startswith("EngineFailed: engine 'llm'")

    engine = ScriptedEngine(lambda p: "ans " + p.rsplit(":", 1)[1])
    status = run_shard(cfg, 0, attempt=2, engine_factory=lambda p, b, **kw: engine)
    redone = {int(p.rsplit("r", 1)[1]) for p in engine.prompts}
    assert redone == set(range(9)) - committed  # committed rows are not asked again
    records = _records(tmp_path)
    assert [r["source_index"] for r in records] == list(range(9))  # each exactly once
    assert all(r["a"] == f"ans r{r['source_index']}" for r in records)
    assert status["stats"]["rows_resumed"] == len(committed) and status["stats"]["rows_processed"] == 9
    assert not (cfg.shard_dir(0) / "failure.json").exists()


def test_a_stopped_shard_logs_its_error_once_and_numbers_its_attempts(tmp_path, caplog):
    """A shard that fails logs no asyncio "_GatheringFuture exception was never retrieved"
    traceback (its cancelled workers' gather is read), and a shard resumed by new snakemake
    runs (whose attempt counter starts at 1 each time) numbers its attempts 1, 2, 3."""
    import asyncio
    import gc

    class Slow(ScriptedEngine):  # one request crashes while the others are still in flight
        async def generate_one(self, r):
            if not r.prompt.endswith(":r2"):
                await asyncio.sleep(0.5)
            return await super().generate_one(r)

    def crash_on_r2(prompt):
        if prompt.endswith(":r2"):
            raise EngineCrash("engine died")
        return "x"

    cfg = shard_config(tmp_path, [{"q": f"r{i}"} for i in range(9)], PLAIN)
    with caplog.at_level("ERROR", logger="asyncio"):
        for _ in range(2):
            with pytest.raises(ShardFailed, match="EngineCrash"):
                run_shard(cfg, 0, attempt=1, engine_factory=lambda p, b, **kw: Slow(crash_on_r2))
            gc.collect()  # asyncio logs an unretrieved exception when the future is collected
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    status = run_shard(cfg, 0, attempt=1, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda p: "x"))
    attempts = status["stats"]["attempts"]
    assert [(a["attempt"], a["snakemake_attempt"], a["outcome"]) for a in attempts] == [
        (1, 1, "failed"), (2, 1, "failed"), (3, 1, "success")]  # fmt: skip


def test_orphan_part_from_a_crash_between_rename_and_manifest_is_discarded(tmp_path):
    cfg = shard_config(tmp_path, [{"q": f"r{i}"} for i in range(4)], PLAIN)
    run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda p: "x"))
    orphan = tmp_path / "out" / "shard_0" / "part-00099.parquet"
    orphan.write_bytes((tmp_path / "out" / "shard_0" / "part-00000.parquet").read_bytes())
    (cfg.shard_dir(0) / "status.json").unlink()
    run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda p: "x"))
    assert not orphan.exists()
    assert [r["source_index"] for r in _records(tmp_path)] == [0, 1, 2, 3]


def test_changed_prompt_discards_old_parts(tmp_path, caplog):
    rows = [{"q": f"r{i}"} for i in range(4)]
    cfg = shard_config(tmp_path, rows, PLAIN)
    run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda p: "old"))
    cfg2 = shard_config(tmp_path, rows, [{"name": "a", "prompt": "new {{ q }}"}])
    engine = ScriptedEngine(lambda p: p.rsplit(":", 1)[1])
    run_shard(cfg2, 0, engine_factory=lambda p, b, **kw: engine)
    assert len(engine.prompts) == 4
    assert [r["a"] for r in _records(tmp_path)] == [f"new r{i}" for i in range(4)]
    assert "discarding" in caplog.text


def test_retry_failed_rows_recomputes_only_the_failures(tmp_path):
    rows = [{"q": f"r{i}"} for i in range(6)]
    cfg = shard_config(tmp_path, rows, [JSON_OUTPUT])
    flaky = lambda p: '{"n": 1}' if p.endswith(("r0", "r2", "r4")) else "oops"  # noqa: E731
    first = run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(flaky))
    assert first["stats"]["rows_failed"] == 3
    rerun = shard_config(tmp_path, rows, [JSON_OUTPUT])
    object.__setattr__(rerun, "retry_failed_rows", True)
    engine = ScriptedEngine(lambda p: '{"n": 2}')
    status = run_shard(rerun, 0, engine_factory=lambda p, b, **kw: engine)
    assert sorted(p.rsplit(":", 1)[1] for p in engine.prompts) == ["r1", "r3", "r5"]
    assert [r["a"]["n"] for r in _records(tmp_path)] == [1, 2, 1, 2, 1, 2]
    assert status["stats"]["rows_failed"] == 0 and row_errors(cfg) == []


def test_error_budget_fails_the_shard_and_keeps_committed_rows(tmp_path):
    rows = [{"q": "ok"}, {"q": "ok"}, {"x": 1}, {"x": 2}, {"x": 3}, {"q": "ok"}]
    cfg = shard_config(tmp_path, rows, PLAIN)
    # in source order (prefix-aware feeding would ask the failing rows last)
    object.__setattr__(cfg, "shard", type(cfg.shard)(**{**vars(cfg.shard), "max_errors": 2, "prefix_order": "none"}))
    with pytest.raises(ShardFailed, match=r"error budget exceeded in shard 0: 3 of 5 rows failed \(missing_variable: 3\)"):
        run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda p: "x"))
    assert [e["source_index"] for e in row_errors(cfg)] == [2, 3, 4]
    assert {0, 1} <= {r["source_index"] for r in _records(tmp_path)} <= {0, 1, 5}  # rows that finished stay


def test_full_disk_fails_clearly_and_keeps_earlier_parts(tmp_path, monkeypatch):
    import errno

    from mirageflow.shard import checkpoint

    cfg = shard_config(tmp_path, [{"q": f"r{i}"} for i in range(6)], PLAIN)
    real, calls = checkpoint.write_part, {"n": 0}

    def write_part(path, records, fmt):
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, records, fmt)

    monkeypatch.setattr(checkpoint, "write_part", write_part)
    with pytest.raises(ShardFailed, match="No space left on device.*rows committed before are intact"):
        run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda p: "x"))
    assert [r["source_index"] for r in _records(tmp_path)] == [0, 1]


def test_a_second_copy_of_a_running_shard_fails_clearly(tmp_path, monkeypatch):
    from mirageflow.shard import checkpoint
    from mirageflow.shard.checkpoint import Lease, ShardBusy

    monkeypatch.setattr(checkpoint.shutil, "which", lambda name: None)  # no squeue: job 42 may be alive

    cfg = shard_config(tmp_path, [{"q": "a"}], PLAIN)
    cfg.shard_dir(0).mkdir(parents=True)
    atomic_write_json(
        cfg.shard_dir(0) / "lease.json", {"hostname": "node7", "pid": 1, "slurm_job_id": "42", "heartbeat": __import__("time").time()}
    )
    with pytest.raises(ShardBusy, match=r"shard_0 is being run by host node7 pid 1 \(SLURM job 42\)"):
        run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda p: "x"))
    assert json.loads((cfg.shard_dir(0) / "lease.json").read_text())["hostname"] == "node7"  # not removed

    atomic_write_json(cfg.shard_dir(0) / "lease.json", {"hostname": "node7", "pid": 1, "slurm_job_id": "42", "heartbeat": 0})
    run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda p: "x"))  # stale: taken over
    assert not (cfg.shard_dir(0) / "lease.json").exists()
    assert not Lease(cfg.shard_dir(0), 300).held()


def test_sigterm_commits_finished_rows_records_why_and_stops(tmp_path):
    import asyncio
    import os
    import signal

    from mirageflow.shard import ShardInterrupted

    class SlowEngine(ScriptedEngine):
        async def generate_one(self, r):
            self.prompts.append(r.prompt)
            if len(self.prompts) == 5:
                os.kill(os.getpid(), signal.SIGTERM)
            if len(self.prompts) >= 5:
                await asyncio.sleep(30)  # would hang without the signal handling
            return Completion(r.id, "x", 1, 1, "stop")

    cfg = shard_config(tmp_path, [{"q": f"r{i}"} for i in range(20)], PLAIN)
    object.__setattr__(cfg, "shard", type(cfg.shard)(**{**vars(cfg.shard), "max_inflight": 1}))
    engine = SlowEngine(None)
    with pytest.raises(ShardInterrupted):
        run_shard(cfg, 0, engine_factory=lambda p, b, **kw: engine)
    failure = json.loads((cfg.shard_dir(0) / "failure.json").read_text())
    assert failure["signal"] == "SIGTERM" and "4 rows committed" in failure["error"]
    assert [r["source_index"] for r in _records(tmp_path)] == [0, 1, 2, 3]
    assert engine.closed and not (cfg.shard_dir(0) / "lease.json").exists()


def test_each_kind_of_bad_row_is_recorded_with_its_class_and_good_rows_all_kept(tmp_path):
    rows = [
        {"q": "good1"},
        "{this is not json",                 # 1 malformed line
        "[1, 2, 3]",                         # 2 not an object
        {"other": "no q"},                   # 3 missing key
        {"q": {"nested": True}},             # 4 template error: q.word is undefined
        {"q": "toolong"},                    # 5 prompt over the context
        {"q": "abort"},                      # 6 generation aborted
        {"q": "notjson"},                    # 7 answer is not JSON
        {"q": "badschema"},                  # 8 answer breaks the schema
        {"q": "truncated"},                  # 9 JSON cut off by max_new_tokens
        {"q": "good2"},
    ]  # fmt: skip
    output = {**JSON_OUTPUT, "prompt": "{{ q if q is string else q.word }}"}
    cfg = shard_config(tmp_path, rows, [output])

    def answer(prompt):
        key = prompt.split(":", 1)[1]
        return {
            "toolong": Completion(0, "", 9999, 0, "abort", "context_length", "prompt has 9999 tokens"),
            "abort": Completion(0, "partial", 5, 3, "abort"),
            "notjson": "no json here",
            "badschema": '{"n": "three"}',
            "truncated": Completion(0, '{"n": 1', 5, 16, "length"),
        }.get(key, '{"n": 5}')

    status = run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(answer))
    got = {e["source_index"]: (e["stage"], e["error"]) for e in row_errors(cfg)}
    assert got == {
        1: ("read", "bad_row"), 2: ("read", "bad_row"), 3: ("extract", "missing_variable"),
        4: ("render", "template_error"), 5: ("generate", "context_length"), 6: ("generate", "aborted"),
        7: ("output", "json_parse"), 8: ("output", "json_schema"), 9: ("output", "json_truncated"),
    }  # fmt: skip
    errors = {e["source_index"]: e for e in row_errors(cfg)}
    assert "in.jsonl:2" in errors[1]["message"] and errors[8]["raw"] == '{"n": "three"}'
    assert [r["source_index"] for r in _records(tmp_path)] == [0, 10]
    assert status["stats"]["rows_failed"] == 9 and sum(status["stats"]["rows_failed_by_class"].values()) == 9

    strict = shard_config(tmp_path, rows, [output])
    object.__setattr__(strict, "shard", type(strict.shard)(**{**vars(strict.shard), "max_error_rate": 0.5}))
    with pytest.raises(ShardFailed, match="error budget exceeded in shard 0: 9 of 11 rows failed"):
        run_shard(strict, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(answer))


def test_sigterm_while_the_engine_loads_is_recorded_too(tmp_path):
    import os
    import signal

    from mirageflow.shard import ShardInterrupted

    class SlowLoad(ScriptedEngine):
        def load(self):
            os.kill(os.getpid(), signal.SIGTERM)

    cfg = shard_config(tmp_path, [{"q": "a"}], PLAIN)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ShardInterrupted):
        run_shard(cfg, 0, engine_factory=lambda p, b, **kw: SlowLoad(lambda p: "x"))
    assert json.loads((cfg.shard_dir(0) / "failure.json").read_text())["signal"] == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored


def test_a_lease_whose_slurm_job_has_ended_is_taken_over(tmp_path, monkeypatch):
    import os
    import time

    cfg = shard_config(tmp_path, [{"q": "a"}], PLAIN)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    squeue = fake_bin / "squeue"
    squeue.write_text("#!/bin/sh\necho CANCELLED\n")  # what squeue says of a job that just ended
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    cfg.shard_dir(0).mkdir(parents=True)
    atomic_write_json(cfg.shard_dir(0) / "lease.json", {"hostname": "node7", "pid": 1, "slurm_job_id": "42", "heartbeat": time.time()})
    status = run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda p: "x"))
    assert status["status"] == "success"


def test_a_lease_of_an_earlier_run_of_this_requeued_slurm_job_is_taken_over(tmp_path, monkeypatch):
    """A preempted job requeued by SLURM keeps its job id; squeue says RUNNING (it is us)."""
    import os
    import time

    cfg = shard_config(tmp_path, [{"q": "a"}], PLAIN)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "squeue").write_text("#!/bin/sh\necho RUNNING\n")
    (fake_bin / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    cfg.shard_dir(0).mkdir(parents=True)
    atomic_write_json(cfg.shard_dir(0) / "lease.json", {"hostname": "node7", "pid": 1, "slurm_job_id": "42", "heartbeat": time.time()})
    monkeypatch.setenv("SLURM_JOB_ID", "43")  # another job: the holder is alive
    with pytest.raises(Exception, match="being run by host node7"):
        run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda p: "x"))
    monkeypatch.setenv("SLURM_JOB_ID", "42")  # the same job, requeued
    assert run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda p: "x"))["status"] == "success"


# --------------------------------------------------------------------------- prefix-aware feeding


DOCS = {"A": "alpha " * 20, "B": "beta " * 20, "C": "gamma " * 20}
SHUFFLED = [f"{d}{q}" for q in range(4) for d in "CAB"]  # C0 A0 B0 C1 A1 B1 ...


def _prefix_setup(tmp_path, mode: str, **shard):
    rows = [{"doc": DOCS[key[0]], "q": f"question {key}"} for key in SHUFFLED]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config({
        "processors": [{"type": "llm", "server_args": {"model_path": "unused"}}],
        "loading_params": {"state_dir": str(tmp_path / "state"),
                           "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(tmp_path / "out")}]},
        "shard_params": {"max_error_rate": 1.0, "checkpoint_rows": 2, "checkpoint_min_seconds": 0, "max_inflight": 1,
                         "prefix_order": mode, **shard},
        "processing_params": {"inputs": [{"name": "doc", "key": "doc"}, {"name": "q", "key": "q"}],
                              "outputs": [{"name": "a", "prompt": "{{ doc }}\nQ: {{ q }}"}],
                              "remove_columns": True, "output_schema": {"q": "{{ q }}", "a": "{{ a }}"}},
    })  # fmt: skip
    index_datasets(cfg)
    return cfg


def _asked(engine) -> list[str]:
    return [p.rsplit("question ", 1)[1] for p in engine.prompts]


@pytest.mark.parametrize("mode", ["shard", "window", "none"])
def test_rows_sharing_a_prompt_prefix_are_fed_together_and_written_as_before(tmp_path, mode):
    """One row in flight (a window of 1, blocks of 4 rows): ``shard`` asks each document's
    rows one after another, ``window`` sorts each block of 4 (a serpentine), ``none`` keeps the source
    order; the records are the same, in source order, whatever the feeding order."""
    cfg = _prefix_setup(tmp_path, mode)
    engine = ScriptedEngine(lambda p: "answer to " + p.rsplit("question ", 1)[1])
    run_shard(cfg, 0, engine_factory=lambda p, b, **kw: engine)
    asked = _asked(engine)
    if mode == "shard":
        assert asked == sorted(SHUFFLED)  # A0 A1 A2 A3 B0 ... : each document's prefix once in a row
    elif mode == "window":
        # blocks of 4, ascending and descending in turn: each block starts where the last ended
        assert asked == [k for i in range(0, 12, 4) for k in sorted(SHUFFLED[i : i + 4], reverse=i % 8 == 4)]
    else:
        assert asked == SHUFFLED
    records = _records(tmp_path)
    assert [r["source_index"] for r in records] == list(range(12))
    assert [r["a"] for r in records] == [f"answer to {k}" for k in SHUFFLED]


def test_a_shard_fed_by_prefix_resumes_exactly(tmp_path):
    """A crash mid-run with rows fed out of source order: the rerun asks exactly the rows
    not committed, and every row is written once."""
    cfg = _prefix_setup(tmp_path, "shard")
    calls = {"n": 0}

    def crash_after_5(prompt):
        calls["n"] += 1
        if calls["n"] > 5:
            raise EngineCrash("engine died")
        return "answer to " + prompt.rsplit("question ", 1)[1]

    with pytest.raises(ShardFailed, match="EngineCrash"):
        run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(crash_after_5))
    committed = {r["q"].split()[1] for r in _records(tmp_path)}
    assert committed and committed <= set(sorted(SHUFFLED)[:5])  # the first rows fed: document A's
    engine = ScriptedEngine(lambda p: "answer to " + p.rsplit("question ", 1)[1])
    run_shard(cfg, 0, engine_factory=lambda p, b, **kw: engine)
    assert sorted(_asked(engine)) == sorted(set(SHUFFLED) - committed)
    records = _records(tmp_path)
    assert [r["source_index"] for r in records] == list(range(12))
    assert [r["a"] for r in records] == [f"answer to {k}" for k in SHUFFLED]


def test_prefix_order_keeps_source_order_when_a_python_step_comes_first():
    from mirageflow.shard import prefix_order
    from mirageflow.shard.steps.base import Step

    class Custom(Step):
        async def run(self, variables, unit):
            return True

    class Filter(Custom):
        once_per_row = True

    class LLM(Step):
        calls_engine = True

    llm = LLM()
    assert prefix_order.keyed_step([Custom(), llm]) is None  # a custom step (not a filter) first
    assert prefix_order.keyed_step([llm]) is llm
    assert prefix_order.keyed_step([Filter(), llm]) is llm
    units = [("b", 1), ("a", 2), ("b", 0), ("a", 1)]
    # blocks of 2, ascending then descending (a serpentine: "b" twice in a row at the seam)
    assert list(prefix_order.ordered(units, lambda u: u[0], 2)) == [("a", 2), ("b", 1), ("b", 0), ("a", 1)]
    assert list(prefix_order.ordered(units, lambda u: u[0], None)) == [("a", 2), ("a", 1), ("b", 1), ("b", 0)]
    assert list(prefix_order.ordered([], lambda u: u, None)) == []


def test_rows_that_will_fail_are_fed_last_in_their_block_not_first(tmp_path):
    """Prefix-aware feeding must not move failures to the front, where the error budget's
    mid-run check (after min_rows_for_error_rate rows) would see more of them than in source
    order: 10 % failing rows, spread, pass a 12 % budget checked after 20 rows."""
    rows = [{"x": i} if i % 10 == 5 else {"q": f"r{i}"} for i in range(100)]
    cfg = shard_config(tmp_path, rows, PLAIN)
    shard = {**vars(cfg.shard), "max_error_rate": 0.12, "min_rows_for_error_rate": 20, "max_inflight": 8, "prefix_order": "window"}
    object.__setattr__(cfg, "shard", type(cfg.shard)(**shard))
    status = run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda p: "x"))
    assert (status["stats"]["rows_processed"], status["stats"]["rows_failed"]) == (90, 10)
