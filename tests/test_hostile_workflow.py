"""Issue 22 through the whole workflow (real `snakemake`, the openai backend against the fake
server): secrets never reach disk (item 12), edits are seen whatever the clock says (13),
reserved record names (14), dry runs and lint change nothing (15), damaged derived state is
rebuilt (16), deep rows stay readable (19), mistakes named by key (20). Each test names its item."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO, run_workflow, shard_jobs
from fakes.fake_http import FakeServer
from fakes.runs import files_on_disk, merged_rows

from mirageflow.data.writers import is_json_field

pytestmark = pytest.mark.usefixtures("no_proxy")

TRIGGERS = {"default": (), "mtime": ("--rerun-triggers", "mtime")}


@pytest.fixture(scope="module")
def server():
    s = FakeServer().start()
    yield s
    s.stop()


def pipeline(root: Path, server: FakeServer, rows: list[dict] | None = None, fmt: str = "jsonl") -> dict:
    data = root / "in.jsonl"
    if rows is not None or not data.exists():
        rows = rows or [{"text": f"passage {i}"} for i in range(6)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "processors": [{
            "type": "llm", "backend": "openai", "base_url": server.url + "/v1", "server_args": {"model_path": "fake-model"},
            "default_sampling_params": {"max_new_tokens": 5}, "max_retries": 0, "request_timeout": 30,
        }],
        "loading_params": {
            "state_dir": "state", "num_shards": 2,
            "datasets": [{"path": "in.jsonl", "type": "jsonl", "output_dir": "out", "output_format": fmt}],
        },
        "processing_params": {
            "inputs": [{"name": "text", "key": "text"}],
            "outputs": [{"name": "answer", "prompt": "Summarise: {{ text }}"}],
        },
    }  # fmt: skip


def prompts_sent(server: FakeServer, n: int) -> list[str]:
    return sorted(r["body"]["messages"][-1]["content"] for r in server.records[-n:])


def all_text(root: Path) -> str:
    """Every file written under root (logs, state files, reports, records), as text."""
    out = []
    for p in root.rglob("*"):
        if p.is_file() and p.name != "pipeline.yaml":
            out.append(f"--- {p}\n" + p.read_bytes().decode("utf-8", "replace"))
    return "\n".join(out)


# --------------------------------------------------------------------------- item 12


def test_item12_no_secret_from_the_url_or_the_environment_reaches_disk(tmp_path, server):
    """Item 12: a password in base_url reached the logs (httpx's INFO line) and
    <state_dir>/configs/<hash>.json; a query parameter reached failure.json, checkpoint.json
    and the logs. Now none of them holds either, and the run still reaches the server."""
    secret_pw, secret_q = "pw-Zq81xJ", "tok-Hh2947xYz"
    cfg = pipeline(tmp_path, server)
    host = server.url.split("://", 1)[1]
    cfg["processors"][0]["base_url"] = f"http://alice:{secret_pw}@{host}/v1"
    proc = run_workflow(tmp_path, cfg, "--printshellcmds")
    assert shard_jobs(proc) == 2 and len(merged_rows(tmp_path)) == 6
    assert server.records[-1]["headers"].get("Authorization", "").startswith("Basic ")  # the password was used
    stored = list((tmp_path / "state" / "configs").glob("*.json"))
    assert stored and "${MIRAGEFLOW_SECRET_1}" in stored[0].read_text()
    text = all_text(tmp_path) + proc.text
    assert secret_pw not in text, [line for line in text.splitlines() if secret_pw in line][:5]

    # a secret from the environment, in the URL's query: the shards fail (the URL is not the
    # server's), and what is written about them names the URL without the secret
    root = tmp_path / "q"
    root.mkdir()
    cfg = pipeline(root, server)
    cfg["processors"][0]["base_url"] = server.url + "/v1?key=${MIRAGEFLOW_TEST_TOKEN}"
    (root / "pipeline.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    env_proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(root),
         "--configfile", str(root / "pipeline.yaml"), "--cores", "1", "--printshellcmds"],
        capture_output=True, text=True, env={**os.environ, "MIRAGEFLOW_TEST_TOKEN": secret_q},
    )  # fmt: skip
    text = all_text(root) + env_proc.stdout + env_proc.stderr
    assert (root / "state").exists()
    assert secret_q not in text, [line for line in text.splitlines() if secret_q in line][:5]


def test_item12_auth_header_and_credentials_are_redacted():
    """Item 12: the auth_header and credentials engine kwargs were written as they are."""
    from mirageflow.redact import redact, redact_text

    assert redact({"auth_header": "Basic c2VjcmV0", "credentials": {"user": "u", "password": "p"}, "tp_size": 2}) == {
        "auth_header": "***", "credentials": "***", "tp_size": 2,
    }  # fmt: skip
    assert redact_text("GET http://h/v1/x?key=abc&sig=def#frag") == "GET http://h/v1/x?key=***&sig=***#frag"


def test_item12_the_log_filter_catches_a_library_line(caplog):
    """Item 12: httpx's 'HTTP Request: POST http://user:<pw>@...' line, from any logger."""
    import logging

    from mirageflow.redact import RedactingFilter

    record = logging.LogRecord(
        "httpx", logging.INFO, __file__, 1, 'HTTP Request: POST %s "%s"', ("http://u:s3cr3t@h/v1?k=qq9", "200 OK"), None
    )
    RedactingFilter().filter(record)
    assert "s3cr3t" not in record.getMessage() and "qq9" not in record.getMessage()


# --------------------------------------------------------------------------- item 13


@pytest.mark.parametrize("trigger", sorted(TRIGGERS))
def test_item13_a_dataset_edited_with_an_old_mtime_reruns(tmp_path, server, trigger):
    """Item 13: a dataset edited with its mtime in the past (cp -p, rsync -a) reran nothing
    under --rerun-triggers mtime; merged/ kept the old text. Now the content decides."""
    flags = TRIGGERS[trigger]
    cfg = pipeline(tmp_path, server)
    run_workflow(tmp_path, cfg, *flags)
    data = tmp_path / "in.jsonl"
    st = data.stat()
    edited = tmp_path / "edited.jsonl"
    edited.write_text(data.read_text().replace("passage 4", "PASSAGE X"))
    os.utime(edited, ns=(st.st_atime_ns, st.st_mtime_ns))
    subprocess.run(["cp", "-p", str(edited), str(data)], check=True)  # same size, same mtime
    assert data.stat().st_mtime_ns == st.st_mtime_ns
    dry = run_workflow(tmp_path, cfg, "-n", *flags)
    assert "rule index_dataset" in dry.text and shard_jobs(dry) == 2, dry.text[-2000:]
    run_workflow(tmp_path, cfg, *flags)
    assert "Summarise: PASSAGE X" in [r["body"]["messages"][-1]["content"] for r in server.records]
    assert any(r["text"] == "PASSAGE X" for r in merged_rows(tmp_path)) or any("PASSAGE X" in json.dumps(r) for r in merged_rows(tmp_path))
    assert "Nothing to be done" in run_workflow(tmp_path, cfg, *flags).text


@pytest.mark.parametrize("trigger", sorted(TRIGGERS))
def test_item13_an_image_whose_content_changed_reruns_its_shard(tmp_path, server, trigger):
    """Item 13: changing an image file's content reran nothing; now exactly the shard that
    read it reruns, and its rows are made again from the new image."""
    import io

    from PIL import Image

    def png(color) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (4, 4), color).save(buf, format="PNG")
        return buf.getvalue()

    flags = TRIGGERS[trigger]
    (tmp_path / "img").mkdir()
    for i in range(4):
        (tmp_path / "img" / f"{i}.png").write_bytes(png((10 * i, 0, 0)))
    cfg = pipeline(tmp_path, server, rows=[{"text": f"p{i}", "img": f"img/{i}.png"} for i in range(4)])
    cfg["processing_params"]["inputs"].append({"name": "img", "key": "img", "type": "image"})
    cfg["processing_params"]["outputs"][0]["prompt"] = "{{ img }} Describe: {{ text }}"
    run_workflow(tmp_path, cfg, *flags)
    done = {i: (tmp_path / f"state/shard_{i}/status.json").stat().st_mtime_ns for i in range(2)}
    target = tmp_path / "img" / "3.png"  # a row of shard 1
    st = target.stat()
    target.write_bytes(png((0, 0, 255)))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # content changed, mtime as before
    dry = run_workflow(tmp_path, cfg, "-n", *flags)
    assert shard_jobs(dry) == 1 and "wildcards: shard=1" in dry.text, dry.text[-2000:]
    sent = len(server.records)
    run_workflow(tmp_path, cfg, *flags)
    assert (tmp_path / "state/shard_0/status.json").stat().st_mtime_ns == done[0]
    assert (tmp_path / "state/shard_1/status.json").stat().st_mtime_ns > done[1]
    assert len(server.records) - sent == 2  # shard 1's two rows, made again
    assert "Nothing to be done" in run_workflow(tmp_path, cfg, *flags).text


# --------------------------------------------------------------------------- item 14


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda c: c["processing_params"]["outputs"][0].update(name="source_index"), "processing_params.outputs[0].name"),
        (lambda c: c["processing_params"]["inputs"].append({"name": "sample_index", "key": "text"}), "processing_params.inputs[1].name"),
        (
            lambda c: c["processing_params"].update(output_schema={"source_index": "{{ answer }}"}),
            "processing_params.output_schema.source_index",
        ),
    ],
)
def test_item14_reserved_record_names_are_refused_at_dag_build(tmp_path, server, edit, key):
    """Item 14: an output, input or output_schema key named source_index was accepted and
    silently overwritten by the row index; now the DAG build refuses it, naming the key."""
    cfg = pipeline(tmp_path, server)
    edit(cfg)
    proc = run_workflow(tmp_path, cfg, "-n", check=False)
    assert proc.returncode != 0 and f"{key}: '" in proc.text and "is reserved" in proc.text, proc.text[-2000:]
    assert not (tmp_path / "state").exists()


# --------------------------------------------------------------------------- items 15, 16


def test_item15_a_dry_run_and_a_lint_change_nothing_on_disk(tmp_path, server):
    """Item 15: `snakemake -n` deleted merged/ and metrics.json when a shard had no
    status.json, and `snakemake --lint` wrote three files. Both now leave the disk as it is."""
    cfg = pipeline(tmp_path, server)
    proc = run_workflow(tmp_path, cfg, "-n")
    assert shard_jobs(proc) == 2 and not (tmp_path / "state").exists() and not (tmp_path / "out").exists()
    run_workflow(tmp_path, cfg)
    (tmp_path / "state" / "shard_1" / "status.json").unlink()
    before = files_on_disk(tmp_path)
    proc = run_workflow(tmp_path, cfg, "-n")
    assert "wildcards: shard=1" in proc.text
    assert files_on_disk(tmp_path) == before
    assert (tmp_path / "out" / "merged").exists() and (tmp_path / "state" / "metrics.json").exists()
    proc = run_workflow(tmp_path, cfg, "--lint", check=False)
    assert files_on_disk(tmp_path) == before, proc.text[-2000:]
    other = tmp_path / "fresh"
    other.mkdir()
    run_workflow(other, pipeline(other, server), "--lint", check=False)
    assert sorted(p.name for p in other.iterdir() if not p.name.startswith(".snakemake")) == ["in.jsonl", "pipeline.yaml"]
    # the real run does what the dry run showed
    run_workflow(tmp_path, cfg)
    assert len(merged_rows(tmp_path)) == 6


def test_item16_a_damaged_stored_config_is_rebuilt_and_merge_temp_dirs_cleaned(tmp_path, server):
    """Item 16: a damaged <state_dir>/configs/<sha>.json was named but never rewritten (every
    rerun failed until it was deleted by hand), and .merged.<hex> temp dirs of a killed merge
    were never cleaned. The driver now rebuilds the one and removes the others."""
    cfg = pipeline(tmp_path, server)
    run_workflow(tmp_path, cfg)
    (stored,) = (tmp_path / "state" / "configs").glob("*.json")
    good = stored.read_bytes()
    stored.write_text('{"processors": [')  # truncated
    leftover = tmp_path / "out" / ".merged.0123456789ab"
    leftover.mkdir()
    (leftover / "part-00000.jsonl").write_text("{}\n")
    (tmp_path / "state" / "shard_0" / "status.json").unlink()  # something to run
    run_workflow(tmp_path, cfg)
    assert stored.read_bytes() == good
    assert not leftover.exists()
    assert len(merged_rows(tmp_path)) == 6


# --------------------------------------------------------------------------- item 19


def test_item19_a_row_nested_200_levels_deep_writes_a_readable_part(tmp_path, server):
    """Item 19: a JSONL row nested 200 levels deep wrote a Parquet part pyarrow refuses to
    open, and the merge called the shard damaged on every rerun. Now the deep column is
    stored as JSON text, losslessly."""
    deep = "leaf"
    for _ in range(200):
        deep = {"a": deep}
    rows = [{"text": "plain", "meta": {"a": 1}}, {"text": "deep", "meta": deep}]
    cfg = pipeline(tmp_path, server, rows=rows, fmt="parquet")
    cfg["processing_params"]["remove_columns"] = False
    cfg["loading_params"]["num_shards"] = 1
    run_workflow(tmp_path, cfg)
    files = sorted((tmp_path / "out" / "merged").glob("*.parquet"))
    table = pq.read_table(files[0])
    assert is_json_field(table.schema.field("meta"))
    got = [json.loads(v) for v in table.column("meta").to_pylist()]
    assert got == [{"a": 1}, deep]


# --------------------------------------------------------------------------- item 20


def test_item20_a_nul_byte_in_output_dir_is_named_by_key(tmp_path, server):
    """Item 20: a NUL byte in output_dir was refused without naming the key."""
    from mirageflow.config import ConfigError, load_config

    cfg = pipeline(tmp_path, server)
    cfg["loading_params"]["datasets"][0]["output_dir"] = "out\0x"
    os.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"loading_params\.datasets\[0\]\.output_dir: holds a NUL byte"):
        load_config(cfg)


def test_item20_a_yaml_merge_key_of_scalars_is_named_by_mmirage(tmp_path):
    """Item 20: `<<: [1, 2]` in the YAML gave a bare WorkflowError; `mmirage check` and the
    mmirage commands that start Snakemake name the line and the problem."""
    (tmp_path / "p.yaml").write_text("processors:\n  - <<: [1, 2]\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mirageflow.cli", "check", "--config", "p.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "expected a mapping for merging" in proc.stderr and "line 2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_item18_preview_never_tracebacks(tmp_path, server):
    """Item 18: `mmirage preview` with --rows beyond the dataset showed nothing, a bad
    conversation row gave a KeyError traceback, a NUL byte in an image path failed the whole
    preview, a custom step calling sys.exit printed a traceback. Each is now shown per row."""
    rows = [
        {"text": "fine", "chat": [{"role": "user", "content": "hi"}], "img": "a.png"},
        {"text": "bad chat", "chat": [{"role": "robot", "content": "x"}], "img": "a.png"},
        {"text": "nul", "chat": [{"role": "user", "content": "hi"}], "img": "a\u0000b.png"},
    ]
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="PNG")
    (tmp_path / "a.png").write_bytes(buf.getvalue())
    cfg = pipeline(tmp_path, server, rows=rows)
    cfg["processing_params"]["inputs"] += [{"name": "chat", "key": "chat"}, {"name": "img", "key": "img", "type": "image"}]
    cfg["processing_params"]["outputs"] = [
        {"name": "answer", "prompt": "{{ img }} {{ text }}"},
        {"name": "reply", "conversation": "chat"},
    ]
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "mirageflow.cli", "preview", "--config", "pipeline.yaml", "--rows", "50"],
                          cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert "--- row 0 ---" in proc.stdout and "--- row 2 ---" in proc.stdout  # all 3 rows, not "up to 922..."
    assert "bad_conversation" in proc.stdout and "image_invalid_value" in proc.stdout

    (tmp_path / "steps.py").write_text(
        "import sys\ndef f(v):\n    if v['text'] == 'nul':\n        sys.exit(3)\n    return v['text'].upper()\n"
    )
    only_steps = copy.deepcopy(cfg)
    only_steps["processors"] = [{"type": "custom", "script_path": "steps.py", "function_name": "f"}]
    only_steps["processing_params"]["inputs"] = [{"name": "text", "key": "text"}]
    only_steps["processing_params"]["outputs"] = [{"name": "up", "type": "custom"}]
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(only_steps, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "mirageflow.cli", "preview", "--config", "pipeline.yaml", "--generate"],
                          cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert "custom_error" in proc.stdout and "sys.exit(3)" in proc.stdout and '"FINE"' in proc.stdout
