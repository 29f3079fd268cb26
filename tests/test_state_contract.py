"""The state contract (mirageflow.state): one layout, one reader, one answer to "is this shard done?".

The end-to-end cases run the real workflow (`python -m snakemake`) against the fake
OpenAI-compatible server of tests/fakes/fake_http.py (a thread of this process), so a run
takes seconds: stale shards after a config edit (issue 23 item 2), `mmirage retry` running
exactly the shards it names (item 3), and the driver's failure summary naming the shard
and the cause for every failure of the chaos set (item 9).
"""

from __future__ import annotations

import ast
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_workflow
from fakes.configs import pipeline_config
from fakes.fake_http import FakeServer

from mirageflow.config import load_config
from mirageflow.files import atomic_write_json
from mirageflow.state import records, shards
from mirageflow.state.layout import StateLayout

ROWS = 8


@pytest.fixture(scope="module")
def server():
    s = FakeServer().start()
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def quiet_progress(no_proxy, monkeypatch):
    monkeypatch.setenv("MIRAGEFLOW_PROGRESS_SECONDS", "0")


def pipeline(root: Path, base_url: str, num_shards: int = 2) -> dict:
    data = root / "in.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"text": f"passage {i}"}) + "\n" for i in range(ROWS)))
    return pipeline_config(
        inputs=["text"], outputs=[{"name": "answer", "prompt": "Summarise: {{ text }}"}], model="fake-model",
        num_shards=num_shards, dataset={"type": "jsonl", "output_format": "jsonl"},
        processor={"backend": "openai", "base_url": base_url, "default_sampling_params": {"max_new_tokens": 5},
                   "max_retries": 0, "request_timeout": 10},
    )  # fmt: skip


def mmirage(root: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "mirageflow.cli", *args], cwd=root, capture_output=True, text=True,
        env={**os.environ, "MIRAGEFLOW_WORKFLOW_DIR": str(REPO)},
    )  # fmt: skip
    proc.text = proc.stdout + proc.stderr
    return proc


def summary_of(proc) -> str:
    """The driver's end-of-run summary in Snakemake's output."""
    text = proc.text
    start = max(text.rfind("mirageflow: run FAILED"), text.rfind("mirageflow: run finished"), text.rfind("mirageflow: run stopped"))
    assert start >= 0, text[-4000:]
    return text[start:]


def shards_run(proc) -> list[int]:
    """The shard jobs Snakemake ran (or, in a dry run, would run), from its job blocks."""
    return sorted(int(m) for m in re.findall(r"rule shard:(?:\n[ \t]+[^\n]*)*?\n[ \t]+wildcards: shard=(\d+)", proc.text))


# --------------------------------------------------------------------------- the layout


def test_the_rules_take_their_paths_from_the_layout(tmp_path, tiny_model):
    """Every output Snakemake plans is a path of StateLayout, and the rule files spell none by hand."""
    for rules in [REPO / "Snakefile", REPO / "workflow" / "Snakefile", *sorted((REPO / "workflow" / "rules").glob("*.smk"))]:
        strings = re.findall(r"""["']([^"'\n]*)["']""", rules.read_text())  # one-line string literals (paths are)
        for literal in (
            "status.json",
            "failure.json",
            "shard_{",
            "index.json",
            "metrics.json",
            "report.html",
            "logs/",
            "merged/",
            "dedup/",
        ):
            found = [x for x in strings if literal in x and not x.startswith("resources/")]  # the demo model is no state
            assert not found, f"{rules.name} spells {literal!r}: take it from StateLayout"
    cfg = pipeline(tmp_path, "unused")
    cfg["processors"] = [{"type": "llm", "backend": "transformers", "server_args": {"model_path": str(tiny_model)}}]
    cfg["deduplication_params"] = {"enabled": True, "text_field": "answer"}
    cfg["execution_params"] = {"shards_per_engine": 2}  # the engine service's endpoint is an input of the shards
    proc = run_workflow(tmp_path, cfg, "--dry-run")
    named = {  # every path a job block names: its inputs, outputs and log
        path.removesuffix(" (service)")
        for kind, paths_ in re.findall(r"\n\s+(input|output|log): ([^\n]*)", proc.text)
        for path in paths_.split(", ")
    }
    paths = StateLayout("state")
    expected = {
        *paths.status_files(2), paths.dataset_index(0), paths.dataset_offsets(0), paths.metrics, paths.summary,
        paths.report_html, paths.merge_manifest(0), paths.dedup_counts(0), paths.dedup_removed(0), paths.fingerprint,
        paths.engine_endpoint(0), paths.shard_log(0), paths.shard_log(1), paths.engine_log(0), paths.log("aggregate"),
        paths.log("index_dataset_0"), paths.log("merge_0"), paths.log("dedup_0"), paths.log("records_fingerprint"),
        paths.log("card"),
        # the dedup stages: one job each for 2 shards (data/dedup_stages.py)
        *paths.dedup_signatures(0, 0).values(), paths.dedup_edges(0, 0),
        paths.log("dedup_signatures_0_0"), paths.log("dedup_pairs_0_0"),
        paths.dedup_decisions(0), paths.dedup_written(0, 0), paths.log("dedup_decide_0"), paths.log("dedup_write_0_0"),
    }  # fmt: skip
    assert {str(p) for p in expected} <= named, {str(p) for p in expected} - named
    assert {p for p in named if p.startswith("state/")} <= {str(p) for p in expected}, "a rule names a state path the layout does not"


def test_the_config_and_the_layout_agree_on_shard_dirs(tmp_path):
    cfg = load_config(pipeline(tmp_path, "http://h:1/v1", num_shards=3), check_paths=False)
    for i in range(3):
        assert cfg.shard_dir(i) == StateLayout(cfg.state_dir).shard_dir(i)


def _imported(node: ast.AST, package: str, modules) -> list[str]:
    """The mirageflow modules an import statement runs: ``from P import x`` runs P (its
    ``__init__``) and P.x when that is a module; relative imports resolved from ``package``."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    if base not in modules:
        return []
    return [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]


def test_no_private_name_crosses_modules_and_no_import_circle():
    """A module uses another's public names only, and no module imports one that imports it back:
    lazy imports (inside a function) count as much as the others, and ``from P import x``
    depends on the package P. A package's ``__init__`` may import its own modules at its top
    (they are what the package is made of); a lazy one there (a re-export on first use) is a
    circle: the module imports the package back."""
    src = REPO / "src"
    modules = {".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): p for p in src.rglob("*.py")}
    crossings, graph = [], {m: set() for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        top_level = {id(n) for stmt in tree.body if isinstance(stmt, (ast.Import, ast.ImportFrom)) for n in ast.walk(stmt)}
        aliases = {}
        for node in ast.walk(tree):
            for target in _imported(node, package, modules):
                own_part = path.name == "__init__.py" and target.startswith(name + ".") and id(node) in top_level
                if target != name and not own_part:
                    graph[name].add(target)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mirageflow"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in modules:
                        aliases[a.asname or a.name] = full
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        crossings.append(f"{name} imports {full}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                if node.attr.startswith("_") and not node.attr.startswith("__"):
                    crossings.append(f"{name} uses {aliases[node.value.id]}.{node.attr}")
    assert crossings == []

    def reaches(start, goal, seen):
        return any(t == goal or (t not in seen and not seen.add(t) and reaches(t, goal, seen)) for t in graph.get(start, ()))

    circles = sorted(f"{m} <-> {t}" for m in graph for t in graph[m] if reaches(t, m, set()))
    assert circles == []


# --------------------------------------------------------------------------- the stats record: one list of keys


def test_the_stats_writer_writes_exactly_the_declared_keys(tmp_path):
    """status.json's ``stats``: ShardMetrics.stats (the writer), ShardStats (the readers' type), the
    checks (STATS_NUMBERS, STATS_REQUIRED) and the sums over attempts all come from STATS_FIELDS."""
    from mirageflow.shard.budget import ErrorBudget
    from mirageflow.shard.metrics import ShardMetrics

    cfg = load_config(pipeline_config(), check_paths=False)
    metrics = ShardMetrics(cfg, attempt=1)
    budget = ErrorBudget(cfg.shard, 0, tmp_path / "errors.jsonl")
    stats = metrics.stats(budget, resumed=0, request_cache={"answers_kept": 0, "bytes": 0})
    assert list(stats) == list(records.STATS_KEYS)
    always = [f.name for f in records.STATS_FIELDS if not f.optional]
    assert list(metrics.stats(budget, resumed=0)) == always
    assert list(records.ShardStats.__annotations__) == list(records.STATS_KEYS)
    assert set(records.STATS_NUMBERS) | set(records.STATS_REQUIRED) | set(records.STATS_SUMMED) <= set(records.STATS_KEYS)
    assert set(records.STATS_SUMMED) <= set(metrics.attempt_entry(0))  # each attempt keeps what the shard sums
    assert records.check_stats(stats, records.STATS_REQUIRED) is None


def _mirageflow_imports(path: Path) -> list[str]:
    """Every mirageflow module ``path`` imports, at the top or lazily inside a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mirageflow"):
            found += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("mirageflow")]
    return found


def test_the_prompts_package_never_imports_the_shard():
    """prompts renders a row's way to the engine and back; the shard job (its steps, its
    failures, its ledger, its row iteration) builds on it, never the other way round."""
    prompts = REPO / "src" / "mirageflow" / "prompts"
    reaching = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in sorted(prompts.rglob("*.py"))
        for name in _mirageflow_imports(path)
        if name == "mirageflow.shard" or name.startswith("mirageflow.shard.")
    ]
    assert reaching == []


def test_every_kind_of_step_is_a_step_and_the_row_path_reads_only_what_it_declares():
    """One shape for LLM, filter, custom and image steps (shard/steps/base.py); the row path
    and the feeding order dispatch on the declared capabilities, never probe attributes."""
    from mirageflow.shard.steps.base import Step, Unit
    from mirageflow.shard.steps.image import ImageStep
    from mirageflow.shard.steps.llm import LLMStep
    from mirageflow.shard.steps.python import CustomStep, FilterStep

    assert [(k.calls_engine, k.once_per_row) for k in (LLMStep, FilterStep, CustomStep, ImageStep)] == [
        (True, False), (False, True), (False, False), (False, False)
    ]  # fmt: skip
    assert all(issubclass(k, Step) for k in (LLMStep, FilterStep, CustomStep, ImageStep))
    with pytest.raises(TypeError, match="implements run"):  # a kind that neither runs nor calls the engine

        class Nothing(Step):
            pass

    assert Unit(1, 2).sample == 0
    shard = REPO / "src" / "mirageflow" / "shard"
    probes = []
    for path in (shard / "rows.py", shard / "prefix_order.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "isinstance"):
                probes.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")  # the kind asked, not declared
            elif isinstance(node, ast.Compare) and any(
                isinstance(side, ast.Attribute) and side.attr == "engine" for side in (node.left, *node.comparators)
            ):
                probes.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")  # an engine's presence as the kind
            elif isinstance(node, ast.Attribute) and node.attr == "wants_unit":
                probes.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert probes == []


# --------------------------------------------------------------------------- reading and the state machine


def test_read_names_what_is_wrong_and_picks_the_check_by_file_name(tmp_path):
    paths = StateLayout(tmp_path)
    assert records.read(paths.status(0)) == (None, None)  # absent
    atomic_write_json(paths.progress(0), {"phase": 3})
    assert records.read(paths.progress(0)) == (None, "phase is 3, not a string")
    paths.lease(0).write_text("{")
    data, why = records.read(paths.lease(0))
    assert data is None and why.startswith("not JSON")
    atomic_write_json(paths.failure(0), {"error": "boom", "stats": {"rows_failed": "many"}})
    assert records.read(paths.failure(0))[1] == 'stats.rows_failed is "many", not a number'


def _success(fingerprint: str | None, rows: int = 4) -> dict:
    status = {
        "status": "success", "shard_id": 0, "num_shards": 1, "started_at": "2025-01-01T10:00:00+00:00",
        "finished_at": "2025-01-01T10:01:00+00:00", "hostname": "n1",
        "stats": {"runtime_seconds": 60.0, "inference_runtime_seconds": 50.0, "output_tokens": 40, "num_gpus": 0,
                  "rows_processed": rows, "rows_failed": 0},
    }  # fmt: skip
    return status if fingerprint is None else {**status, "records_fingerprint": fingerprint}


def test_a_status_json_of_another_fingerprint_is_stale_not_done(tmp_path):
    paths = StateLayout(tmp_path)
    atomic_write_json(paths.status(0), _success("a" * 64))
    (entry,) = shards.shard_states(tmp_path, 1, 300, fingerprint="b" * 64)
    assert entry.state == "pending" and entry.stale.startswith("stale: its status.json was written for an earlier config")
    (entry,) = shards.shard_states(tmp_path, 1, 300, fingerprint="a" * 64)
    assert entry.state == "done" and entry.stale is None
    atomic_write_json(paths.status(0), _success(None))  # written before the field existed: current
    assert shards.shard_states(tmp_path, 1, 300, fingerprint="b" * 64)[0].state == "done"


def test_a_shard_whose_process_is_gone_is_failed_not_running(tmp_path):
    """A full disk: the job died without failure.json, its progress.json still fresh."""
    import socket

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    atomic_write_json(StateLayout(tmp_path).progress(0), {
        "phase": "generating", "updated_at_unix": time.time(), "hostname": socket.gethostname(), "pid": int(dead),
    })  # fmt: skip
    (entry,) = shards.shard_states(tmp_path, 1, 300)
    assert entry.state == "failed" and f"its process {dead} on" in entry.error and "is gone" in entry.error


def test_progress_json_saying_failed_without_failure_json_is_a_failed_shard(tmp_path):
    atomic_write_json(StateLayout(tmp_path).progress(0), {"phase": "failed", "updated_at_unix": time.time()})
    (entry,) = shards.shard_states(tmp_path, 1, 300)
    assert entry.state == "failed" and "failure.json" in entry.error


# --------------------------------------------------------------------------- issue 23 item 2: a config edit


def test_after_a_config_edit_stale_shards_are_not_done_for_anyone(tmp_path, server, monkeypatch):
    cfg = pipeline(tmp_path, server.url + "/v1")
    run_workflow(tmp_path, cfg)
    written = json.loads(StateLayout(tmp_path / "state").status(0).read_text())
    assert list(written["stats"]) == list(records.STATS_KEYS)  # a real shard's (its request cache on), through the workflow
    edited = copy.deepcopy(cfg)
    edited["processing_params"]["outputs"][0]["prompt"] = "Condense: {{ text }}"
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(edited, sort_keys=False))
    proc = mmirage(tmp_path, "status", "--config", "pipeline.yaml", "--all")
    assert "done 0, running 0, failed 0, pending 2" in proc.stdout, proc.text
    assert "their status.json is from an earlier config" in proc.stdout and proc.returncode == 3
    proc = mmirage(tmp_path, "merge", "--config", "pipeline.yaml")
    assert proc.returncode == 3 and "pending: [0, 1]" in proc.stderr
    # the driver's live line: the stale status.json files count for nothing (the fingerprint the driver wrote)
    from mirageflow.report.terminal import LiveProgress
    from mirageflow.state.pipeline import write_records_fingerprint

    monkeypatch.chdir(tmp_path)  # state_dir "state" is relative
    write_records_fingerprint(load_config("pipeline.yaml", check_paths=False))  # as the driver does when it parses the edited config
    live = LiveProgress("state", 2, 1.0, lambda s: None, fingerprint=shards.recorded_fingerprint("state"))
    assert [live._done(i) for i in range(2)] == [False, False]
    # the rerun makes them current again
    run_workflow(tmp_path, edited)
    assert "done 2, running 0, failed 0, pending 0" in mmirage(tmp_path, "status", "--config", "pipeline.yaml").stdout


# --------------------------------------------------------------------------- issue 23 item 3: retry


def test_retry_runs_exactly_the_shards_it_names(tmp_path, server):
    """After a prompt edit, two shards failed: retry names all four (two failed, two stale) and Snakemake runs those."""
    cfg = pipeline(tmp_path, server.url + "/v1", num_shards=4)
    run_workflow(tmp_path, cfg)
    edited = copy.deepcopy(cfg)
    edited["processing_params"]["outputs"][0]["prompt"] = "Condense: {{ text }}"
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(edited, sort_keys=False))
    for i in (1, 3):
        (tmp_path / f"state/shard_{i}/status.json").unlink()
        atomic_write_json(tmp_path / f"state/shard_{i}/failure.json", {"status": "failed", "error": "ShardFailed: boom", "signal": None})
    proc = mmirage(tmp_path, "retry", "--config", "pipeline.yaml")
    assert proc.returncode == 0, proc.text[-4000:]
    named = json.loads(re.search(r"retrying \d+ unfinished shard\(s\) (\[[\d, ]*\])", proc.stderr).group(1))
    assert named == [0, 1, 2, 3] and "2 of them stale" in proc.stderr
    assert shards_run(proc) == named
    assert "done 4, running 0, failed 0, pending 0" in mmirage(tmp_path, "status", "--config", "pipeline.yaml").stdout
    assert (tmp_path / "state/metrics.json").exists() and (tmp_path / "out/merged").is_dir()

    # one failed shard, nothing edited: exactly that one runs, then the report without any shard
    (tmp_path / "state/shard_2/status.json").unlink()
    atomic_write_json(tmp_path / "state/shard_2/failure.json", {"status": "failed", "error": "ShardFailed: boom", "signal": None})
    proc = mmirage(tmp_path, "retry", "--config", "pipeline.yaml")
    assert proc.returncode == 0 and "retrying 1 unfinished shard(s) [2]" in proc.stderr and shards_run(proc) == [2]


# --------------------------------------------------------------------------- issue 23 item 9: failure summaries


def _no_wrong_culprit(summary: str) -> None:
    assert "No shard failed" not in summary and "a job of another rule failed" not in summary


def test_a_damaged_config_file_is_written_again_before_the_jobs(tmp_path, server):
    """Issue 22 item 16: the driver (onstart, before any job; a dry run writes nothing) writes
    a damaged stored config again, so the jobs read the config, not the damage."""
    cfg = pipeline(tmp_path, server.url + "/v1")
    run_workflow(tmp_path, cfg, "--until", "records_fingerprint")  # the driver stores the config file
    (stored,) = (tmp_path / "state/configs").glob("*.json")
    stored.write_text('{"processors": [')  # damaged after the driver wrote it
    proc = run_workflow(tmp_path, cfg, "--keep-going")
    assert "is damaged (not the config its name says): writing it again" in proc.text
    assert "mirageflow: run finished" in summary_of(proc) and json.loads(stored.read_text())["processors"]


def test_a_damaged_lease_names_the_shard_and_the_cause(tmp_path, server):
    cfg = pipeline(tmp_path, server.url + "/v1")
    lease = tmp_path / "state/shard_1/lease.json"
    lease.parent.mkdir(parents=True)
    lease.write_text("{not json")
    proc = run_workflow(tmp_path, cfg, "--keep-going", check=False)
    summary = summary_of(proc)
    _no_wrong_culprit(summary)
    assert "shard 1 failed:" in summary and "lease.json is damaged" in summary and "shards: 1 of 2 done, 1 failed" in summary


def test_a_lost_engine_names_the_shard_and_the_cause(tmp_path):
    gone = FakeServer().start()
    url = gone.url + "/v1"
    gone.stop()  # nothing answers there any more
    proc = run_workflow(tmp_path, pipeline(tmp_path, url), "--keep-going", check=False)
    summary = summary_of(proc)
    _no_wrong_culprit(summary)
    assert "shard 0 failed:" in summary and "shard 1 failed:" in summary and "Connect" in summary


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs, filled: needs root (CI runs as root); skipped elsewhere."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True).returncode
    ):
        pytest.skip("cannot mount a small tmpfs (not root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_names_the_shard_and_the_cause(tmp_path, server, full_disk):
    """The output disk is full and failure.json cannot be written either: the summary still
    names the shard's job and the error its log ends with."""
    cfg = pipeline(tmp_path, server.url + "/v1", num_shards=1)
    cfg["loading_params"]["datasets"][0]["output_dir"] = str(full_disk / "out")
    run_workflow(tmp_path, cfg, "--until", "records_fingerprint")  # the driver claims the output_dir while there is room
    try:  # then the disk fills up: no room for a part file
        with open(full_disk / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:
        pass
    (tmp_path / "state/shard_0").mkdir(parents=True)
    (tmp_path / "state/shard_0/failure.json").mkdir()  # as full as the output disk: failure.json cannot be written
    proc = run_workflow(tmp_path, cfg, check=False)
    summary = summary_of(proc)
    _no_wrong_culprit(summary)
    assert "shard 0 failed" in summary and "No space left on device" in summary, summary
    assert "Log: state/logs/shard_0.log" in summary
    shutil.rmtree(tmp_path / "state/shard_0/failure.json")
