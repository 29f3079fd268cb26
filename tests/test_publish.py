"""Publishing to the Hugging Face Hub (issue 39): the dataset card, `mmirage publish` and the
publish rule, against the stand-in hub of tests/fakes/fake_hub.py on 127.0.0.1.

huggingface_hub reads HF_ENDPOINT when it is imported, so every upload runs in a process of
its own (`mmirage publish`, or the workflow's publish rule), as a user runs it, with the
token where `hf auth login` leaves it (HF_HOME/token, in no environment variable: only
mirageflow's own registration of it can keep it out of a log). The fake speaks no Xet
(HF_HUB_DISABLE_XET=1): the upload goes the LFS way, preupload, batch, PUT, commit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import run_workflow
from fakes.configs import pipeline_config
from fakes.fake_http import FakeServer
from fakes.fake_hub import FakeHub, HubRepo
from fakes.runs import finish_shard

from mirageflow.config import load_config
from mirageflow.data.dedup_stages import dedup_dataset
from mirageflow.data.merge import merge_dataset
from mirageflow.files import atomic_write_json
from mirageflow.hub_models import hub_models, marker_path
from mirageflow.publish.card import CardInputs, render_card, write_local_cards
from mirageflow.report.aggregate import write_report
from mirageflow.state.layout import StateLayout
from mirageflow.state.pipeline import mark_previous_results

pytestmark = pytest.mark.usefixtures("no_proxy")

TOKEN = "hf_" + "Zq7" * 12  # a token as the Hub issues them
SECRET = "pw-Kx93mq"  # a password written in the config's base_url
SHARDS = 3
ROWS_PER_SHARD = 12


@pytest.fixture
def hub():
    h = FakeHub({}).start()
    h.token = TOKEN
    yield h
    h.stop()


def make_run(root: Path, fmt: str = "parquet", license: str | None = "cc-by-4.0", dedup: bool = False) -> Path:
    """A finished run by hand: SHARDS shards of ROWS_PER_SHARD records (random text, so the
    Parquet files do not compress to nothing; with ``dedup`` every fourth record repeats the
    first), merged and deduplicated, its metrics.json and its card.
    Returns the config file."""
    rng = random.Random(7)
    src = root / "in.jsonl"
    src.write_text("".join(json.dumps({"q": f"row {i}"}) + "\n" for i in range(SHARDS * ROWS_PER_SHARD)))
    config = pipeline_config(
        src, model="org/model", state_dir=root / "state", output_dir=root / "out", num_shards=SHARDS,
        dataset={"output_format": fmt}, processor={"backend": "openai", "base_url": f"http://user:{SECRET}@127.0.0.1:9/v1"},
        execution_params={"license": license} if license else {},
        **({"deduplication_params": {"enabled": True, "text_field": "a", "fuzzy": False}} if dedup else {}),
    )  # fmt: skip
    config_file = root / "pipeline.yaml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    cfg = load_config(config_file, environ={})
    ds = cfg.datasets[0]
    for shard in range(SHARDS):
        rows = [
            {"source_index": shard * ROWS_PER_SHARD + i, "q": f"row {i}", "a": "".join(rng.choices(string.ascii_letters, k=600))}
            for i in range(ROWS_PER_SHARD)
        ]
        if dedup:
            rows = [{**r, "a": "the same answer"} if r["source_index"] % 4 == 0 else r for r in rows]
        finish_shard(cfg, ds, shard, rows, per_part=ROWS_PER_SHARD)
    paths = StateLayout(cfg.state_dir)
    atomic_write_json(paths.merge_manifest(0), merge_dataset(cfg, ds))
    if dedup:
        dedup_dataset(cfg, ds, cfg.dedup, paths.dedup_counts(0), paths.dedup_removed(0))
    write_report(cfg.state_dir, cfg.num_shards)
    write_local_cards(cfg, config_file)
    return config_file


def hub_environment(hub: FakeHub, root: Path) -> dict:
    """The environment of a process that talks to the stand-in hub, the token in HF_HOME/token."""
    hf_home = root / "hf"
    hf_home.mkdir(exist_ok=True)
    (hf_home / "token").write_text(TOKEN)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE")}
    return env | {"HF_ENDPOINT": hub.url, "HF_HOME": str(hf_home), "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def mmirage(*args: str, hub: FakeHub, root: Path, background: bool = False):
    """`mmirage ...` in its own process, pointed at the stand-in hub."""
    env = hub_environment(hub, root)
    cmd = [sys.executable, "-m", "mirageflow.cli", *args]
    if background:
        return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    proc.text = proc.stdout + proc.stderr
    return proc


def repo_files(hub: FakeHub, repo_id: str, revision: str = "main") -> dict[str, bytes]:
    return hub.datasets[repo_id][revision].files


def mirror(files: dict[str, bytes], where: Path) -> Path:
    """The repo's files in a folder: `datasets.load_dataset` reads it as it reads the repo (the card's configs)."""
    for name, data in files.items():
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_bytes(data)
    return where


def no_token_anywhere(root: Path, *texts: str) -> None:
    for text in texts:
        assert TOKEN not in text
    for path in root.rglob("*"):
        if path.is_file() and path.name != "token":  # huggingface_hub's own login file
            assert TOKEN.encode() not in path.read_bytes(), path


# --------------------------------------------------------------------------- the card


def test_the_card_is_the_runs_figures_with_the_hubs_header_and_no_secret(tmp_path):
    config_file = make_run(tmp_path)
    card = (tmp_path / "out" / "README.md").read_text()
    _, head, body = card.split("---\n", 2)
    meta = yaml.safe_load(head)
    assert meta["license"] == "cc-by-4.0"
    assert meta["size_categories"] == ["n<1K"]
    assert meta["configs"] == [{"config_name": "out", "data_files": [{"split": "train", "path": "data/out/*.parquet"}]}]
    pid = json.loads(StateLayout(tmp_path / "state").pipeline_id.read_text())["pipeline_id"]
    assert meta["mirageflow"] == {"pipeline_id": pid, "partial": False}
    agg = json.loads((tmp_path / "state" / "metrics.json").read_text())["aggregate"]
    assert f"| source rows processed | {agg['total_rows_processed']} |" in body
    assert f"| shards completed | {SHARDS} of {SHARDS} |" in body
    assert agg["cost_usd"] == 0 and "| cost (USD) | $0.0000 |" in body  # a server on 127.0.0.1: self-hosted, free
    assert f"| `out` | `{tmp_path / 'in.jsonl'}` | {SHARDS * ROWS_PER_SHARD} |" in body
    assert "| `llm` | openai | `org/model` |" in body
    assert "Summarise" not in body and "{{ q }}" in body  # the prompt as written
    assert SECRET not in card and "base_url: http://user:***@127.0.0.1:9/v1" in body  # the config, its secret masked
    assert "key: q" in body  # a JMESPath key is no secret
    cfg = load_config(config_file, environ={})
    assert write_local_cards(cfg, config_file) and (tmp_path / "out" / "README.md").read_text() == card  # the same run, the same card


def test_the_cards_cost_says_what_has_no_known_price():
    from mirageflow.publish.card import _run_section

    def cost(agg):
        (line,) = [line for line in _run_section(agg) if line.startswith("| cost (USD) |")]
        return line

    assert cost({"cost_usd": 1.5, "cost_unpriced_tokens": 120}) == "| cost (USD) | $1.5000 (+ 120 tokens with no known price) |"
    assert cost({"cost_usd": None, "cost_unpriced_tokens": 0}) == "| cost (USD) | n/a |"


def test_the_card_names_the_commit_the_driver_fetched_for_a_hub_model(tmp_path):
    config = pipeline_config(
        tmp_path / "in.jsonl", state_dir=tmp_path / "state", output_dir=tmp_path / "out",
        processor={"backend": "transformers", "server_args": {"model_path": "org/model", "revision": "v1"},
                   "default_sampling_params": {"temperature": 0.3}},
    )  # fmt: skip
    config_file = tmp_path / "pipeline.yaml"
    config_file.write_text(yaml.safe_dump(config))
    cfg = load_config(config_file, environ={}, check_paths=False)
    [model] = hub_models(cfg)
    atomic_write_json(marker_path(cfg.state_dir, model), {"repo_id": "org/model", "revision": "v1", "commit": "c0ffee" * 6})
    card = render_card(cfg, config_file, CardInputs(metrics={}, records={0: 0}))
    assert f'| `llm` | transformers | `org/model` | v1 | {"c0ffee" * 6} | `{{"temperature": 0.3}}` |' in card


# --------------------------------------------------------------------------- mmirage publish


def test_publish_uploads_parquet_that_load_dataset_reads_after_a_429(tmp_path, hub):
    import datasets

    make_run(tmp_path, fmt="jsonl", dedup=True)
    hub.too_many = {"preupload": 1, "commit": 1}  # rate-limited once each: answered, retried
    proc = mmirage("publish", "--config", "pipeline.yaml", "--repo-id", "org/quiz", "--private", hub=hub, root=tmp_path)
    assert proc.returncode == 0, proc.text
    asked = [r[1].split("?")[0] for r in hub.requests]
    # preupload: 429, then again (huggingface_hub's retry); commit: 429, then the whole upload
    # again (ours: huggingface_hub does not retry a commit), which sends no file a second time
    assert asked.count("/api/datasets/org/quiz/preupload/main") == 3 and asked.count("/api/datasets/org/quiz/commit/main") == 2
    assert len(hub.lfs_puts) == 2 * SHARDS == len(set(hub.lfs_puts)) and len(hub.commits) == 1
    assert "org/quiz" in hub.private
    files = repo_files(hub, "org/quiz")
    assert sorted(files) == [
        ".gitattributes", "README.md", *[f"data/out-deduplicated/train-{i:05d}-of-00003.parquet" for i in range(SHARDS)],
        *[f"data/out/train-{i:05d}-of-00003.parquet" for i in range(SHARDS)],
    ]  # fmt: skip
    assert files["README.md"] == (tmp_path / "out" / "README.md").read_bytes()  # what was checked is what was published
    loaded = datasets.load_dataset(str(mirror(files, tmp_path / "repo")), "out", split="train")
    merged = [json.loads(line) for p in sorted((tmp_path / "out" / "merged").glob("*.jsonl")) for line in p.read_text().splitlines()]
    assert loaded.to_list() == merged
    kept = datasets.load_dataset(str(tmp_path / "repo"), "out-deduplicated", split="train")
    counts = json.loads((tmp_path / "state" / "dedup" / "dataset_0.json").read_text())
    assert kept.num_rows == counts["rows_out"] == len(merged) - counts["exact_duplicates_removed"] == len(merged) - SHARDS * 3 + 1
    card = files["README.md"].decode()
    assert f"| `out-deduplicated` | {len(merged)} | {SHARDS * 3 - 1} | 0 | {kept.num_rows} |" in card
    record = json.loads(StateLayout(tmp_path / "state").publish_record.read_text())
    assert record["repo_id"] == "org/quiz" and record["commit"] == hub.datasets["org/quiz"]["main"].commit
    no_token_anywhere(tmp_path, proc.text)

    again = mmirage("publish", "--config", "pipeline.yaml", "--repo-id", "org/quiz", hub=hub, root=tmp_path)
    assert again.returncode == 0, again.text
    assert len(hub.lfs_puts) == 2 * SHARDS  # nothing sent twice


def test_a_killed_upload_goes_on_without_sending_the_finished_files_again(tmp_path, hub):
    make_run(tmp_path)
    hub.upload_plan = [None, None, "hold"]  # the third file arriving is cut before the Hub confirms it
    proc = mmirage("publish", "--config", "pipeline.yaml", "--repo-id", "org/quiz", hub=hub, root=tmp_path, background=True)
    deadline = time.monotonic() + 60
    while not (len(hub.lfs_puts) == 2 and len(hub.sending) == 3) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert len(hub.lfs_puts) == 2 and len(hub.sending) == 3, proc.communicate()[0]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = list(hub.lfs_puts)
    assert "org/quiz" in hub.datasets and "data/out/train-00000-of-00003.parquet" not in repo_files(hub, "org/quiz")  # no commit

    again = mmirage("publish", "--config", "pipeline.yaml", "--repo-id", "org/quiz", hub=hub, root=tmp_path)
    assert again.returncode == 0, again.text
    assert hub.lfs_puts[:2] == finished and len(hub.lfs_puts) == 3 and hub.lfs_puts[2] not in finished  # only the cut one again
    merged = sorted((tmp_path / "out" / "merged").glob("part-*.parquet"))
    files = repo_files(hub, "org/quiz")
    assert [files[f"data/out/train-{i:05d}-of-00003.parquet"] for i in range(SHARDS)] == [p.read_bytes() for p in merged]


def test_a_token_the_hub_echoes_reaches_no_output_and_no_file(tmp_path, hub):
    make_run(tmp_path)
    hub.refuse_writes = True  # 403, the message repeating the caller's token
    proc = mmirage("publish", "--config", "pipeline.yaml", "--repo-id", "org/quiz", hub=hub, root=tmp_path)
    assert proc.returncode == 1, proc.text
    assert "has no write access" in proc.text and "the token *** has" in proc.text, proc.text
    assert "Traceback" not in proc.text
    no_token_anywhere(tmp_path, proc.text)


# --------------------------------------------------------------------------- refusals


def test_a_run_with_a_failed_shard_is_refused_unless_partial(tmp_path, hub):
    config_file = make_run(tmp_path)  # a complete run, then shard 1 ran again and failed:
    cfg = load_config(config_file, environ={})
    mark_previous_results(cfg, "shard 1 started again")  # merged/, metrics.json and the card are the previous run's
    (cfg.shard_dir(1) / "status.json").unlink()
    atomic_write_json(cfg.shard_dir(1) / "failure.json", {"status": "failed", "error": "boom", "attempt": 2})
    card_before = (tmp_path / "out" / "README.md").read_bytes()
    proc = mmirage("publish", "--config", "pipeline.yaml", "--repo-id", "org/quiz", hub=hub, root=tmp_path)
    assert proc.returncode == 1 and "not every shard is done (failed: [1])" in proc.text and "--allow-partial" in proc.text, proc.text
    assert not hub.requests and not hub.datasets  # nothing asked of the Hub

    proc = mmirage("publish", "--config", "pipeline.yaml", "--repo-id", "org/quiz", "--allow-partial", hub=hub, root=tmp_path)
    assert proc.returncode == 0, proc.text
    files = repo_files(hub, "org/quiz")
    rows = [
        r
        for name in sorted(files)
        if name.endswith(".parquet")
        for r in pq.read_table(mirror({name: files[name]}, tmp_path / "r") / name).to_pylist()
    ]
    assert [r["source_index"] for r in rows] == [*range(ROWS_PER_SHARD), *range(2 * ROWS_PER_SHARD, 3 * ROWS_PER_SHARD)]
    card = files["README.md"].decode()
    assert "partial: true" in card and "shard(s) [1] of 3 are not in it" in card and "| shards completed | 2 of 3 |" in card
    assert (tmp_path / "out" / "README.md").read_bytes() == card_before  # beside merged/: the complete run's card stays


@pytest.mark.parametrize("card", ["---\nmirageflow:\n  pipeline_id: 0123abcd\n---\n# theirs\n", "# a dataset made by hand\n"])
def test_a_repo_another_pipeline_made_is_refused_unless_told(tmp_path, hub, card):
    make_run(tmp_path)
    hub.datasets["org/theirs"] = {"main": HubRepo(files={"README.md": card.encode(), "data.csv": b"a\n1\n"})}
    proc = mmirage("publish", "--config", "pipeline.yaml", "--repo-id", "org/theirs", hub=hub, root=tmp_path)
    assert proc.returncode == 1 and "--overwrite-other" in proc.text, proc.text
    assert ("pipeline_id 0123abcd" if "0123abcd" in card else "no mirageflow pipeline") in proc.text
    assert repo_files(hub, "org/theirs")["README.md"] == card.encode() and not hub.commits

    proc = mmirage("publish", "--config", "pipeline.yaml", "--repo-id", "org/theirs", "--overwrite-other", hub=hub, root=tmp_path)
    assert proc.returncode == 0, proc.text
    assert repo_files(hub, "org/theirs")["README.md"] == (tmp_path / "out" / "README.md").read_bytes()


# --------------------------------------------------------------------------- the workflow


def test_retry_makes_a_missing_card(tmp_path, hub):
    """`mmirage retry` ends with the rules that build from the shards; the card is one (the
    default target names it: a rule it may not run would fail the retry)."""
    make_run(tmp_path)
    (tmp_path / "out" / "README.md").unlink()
    proc = mmirage("retry", "--config", "pipeline.yaml", "--", "--dry-run", hub=hub, root=tmp_path)
    assert proc.returncode == 0 and "rule card:" in proc.text, proc.text[-3000:]


def test_the_workflow_writes_the_card_beside_merged_and_publishes_it(tmp_path, hub):
    server = FakeServer().start()
    try:
        data = tmp_path / "in.jsonl"
        data.write_text("".join(json.dumps({"q": f"passage {i}"}) + "\n" for i in range(6)))
        config = pipeline_config(
            data, model="fake-model", num_shards=2, dataset={"output_format": "jsonl"},
            processor={"backend": "openai", "base_url": server.url + "/v1", "default_sampling_params": {"max_new_tokens": 5}},
            execution_params={"license": "mit", "publish": {"repo_id": "org/run", "revision": "v1"}},
        )  # fmt: skip
        run_workflow(tmp_path, config, env=hub_environment(hub, tmp_path) | {"MIRAGEFLOW_PROGRESS_SECONDS": "0"})
    finally:
        server.stop()
    card = (tmp_path / "out" / "README.md").read_bytes()
    assert b"license: mit" in card and b"| `out` | `" in card
    files = repo_files(hub, "org/run", "v1")
    assert files["README.md"] == card and sorted(files) == [
        ".gitattributes",
        "README.md",
        "data/out/train-00000-of-00002.parquet",
        "data/out/train-00001-of-00002.parquet",
    ]
    assert repo_files(hub, "org/run") == {".gitattributes": files[".gitattributes"]}  # main untouched: the branch was asked
    loaded = pq.read_table(mirror(files, tmp_path / "repo") / "data" / "out").to_pylist()
    assert [r["source_index"] for r in loaded] == list(range(6))
    log = (tmp_path / "state" / "logs" / "publish.log").read_text()
    assert "published to org/run" in log
    no_token_anywhere(tmp_path, log)


def test_the_repo_comes_from_the_config_when_no_flag_names_it(tmp_path, hub):
    """`mmirage publish --config C` alone publishes where execution_params.publish says (its
    revision too); a flag given wins; with neither, a usage error that names both."""
    config_file = make_run(tmp_path)
    proc = mmirage("publish", "--config", "pipeline.yaml", hub=hub, root=tmp_path)
    assert proc.returncode == 2 and "no --repo-id" in proc.text and "execution_params.publish.repo_id" in proc.text, proc.text
    assert not hub.requests

    config = yaml.safe_load(config_file.read_text())
    config["execution_params"]["publish"] = {"repo_id": "org/from-config", "revision": "v2"}
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = mmirage("publish", "--config", "pipeline.yaml", hub=hub, root=tmp_path)
    assert proc.returncode == 0, proc.text
    assert "README.md" in repo_files(hub, "org/from-config", "v2")
    proc = mmirage("publish", "--config", "pipeline.yaml", "--repo-id", "org/from-flag", hub=hub, root=tmp_path)
    assert proc.returncode == 0, proc.text
    assert "README.md" in repo_files(hub, "org/from-flag", "v2")  # the config's revision still applies
