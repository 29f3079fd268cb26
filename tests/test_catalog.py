"""Catalog-ready: the Snakemake workflow catalog's usage file (.snakemake-workflow-catalog.yml)
says what is true, and ``snakemake --report report.zip`` builds from a finished run, as the
catalog's usage tells a user to make it (fake OpenAI-compatible server, no model)."""

from __future__ import annotations

import json
import zipfile

import pytest
import yaml
from conftest import REPO, run_workflow
from fakes.fake_http import FakeServer

pytestmark = pytest.mark.usefixtures("no_proxy")


def test_the_catalog_usage_file_has_the_catalog_keys():
    usage = yaml.safe_load((REPO / ".snakemake-workflow-catalog.yml").read_text())["usage"]
    assert set(usage) == {"mandatory-flags", "software-stack-deployment", "report"}
    assert usage["mandatory-flags"]["desc"] and "--configfile" in usage["mandatory-flags"]["flags"]
    assert set(usage["software-stack-deployment"]) == {"conda", "apptainer", "apptainer+conda"}
    assert usage["report"] is True  # the test below holds it to that
    assert (REPO / "config" / "README.md").is_file()  # the catalog shows it as the configuration


def test_the_catalog_finds_the_workflow_where_it_looks_and_the_checkout_runs_the_same_one(tmp_path):
    """The catalog's generator takes workflow/Snakefile whenever a workflow/ folder exists (and
    skips a repository without it), its rule modules as workflow/rules/*.smk. The top-level
    Snakefile the checkout's commands run includes it and names its default target again (an
    included file cannot): both plan the same jobs."""
    import re
    import subprocess
    import sys

    assert (REPO / "workflow" / "Snakefile").is_file()
    assert list((REPO / "workflow" / "rules").glob("*.smk"))
    entry = (REPO / "Snakefile").read_text()
    assert re.findall(r"^(include|rule) ?(\w*):? ?(.*)$", entry, re.M) == [
        ("include", "", '"workflow/Snakefile"'), ("rule", "checkout_all", ""),
    ]  # fmt: skip
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"text": f"passage {i}"}) + "\n" for i in range(6)))
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump({
        "processors": [{"type": "llm", "backend": "openai", "base_url": "http://127.0.0.1:9/v1", "server_args": {"model_path": "m"}}],
        "loading_params": {"state_dir": "state", "num_shards": 3, "datasets": [{"path": str(data), "type": "jsonl", "output_dir": "out"}]},
        "processing_params": {"inputs": [{"name": "text", "key": "text"}], "outputs": [{"name": "s", "prompt": "{{ text }}"}]},
    }))  # fmt: skip
    planned = {}
    for snakefile in ("Snakefile", "workflow/Snakefile"):
        proc = subprocess.run(
            [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / snakefile), "--directory", str(tmp_path),
             "--configfile", str(config), "-n", "--quiet", "rules"],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        planned[snakefile] = {
            m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", proc.stdout, re.M) if not m.group(1).endswith("all")
        }  # fmt: skip
    assert planned["Snakefile"] == planned["workflow/Snakefile"] and planned["Snakefile"]["shard"] == 3
    readme = (REPO / "README.md").read_text()
    usage = readme[readme.index("## Usage, step by step") :]
    steps = re.findall(r"^\d\. \*\*([^*]+)\*\*", usage, re.M)
    assert steps == ["Get the workflow", "Install the software", "Configure", "Run", "Report"]
    assert "--report report.zip" in usage


def test_snakemake_report_builds_from_a_finished_run(tmp_path):
    server = FakeServer().start()
    try:
        data = tmp_path / "in.jsonl"
        data.write_text("".join(json.dumps({"text": f"passage {i}"}) + "\n" for i in range(4)))
        config = {
            "processors": [{
                "type": "llm", "backend": "openai", "base_url": server.url + "/v1",
                "server_args": {"model_path": "fake-model"},
                "default_sampling_params": {"max_new_tokens": 16, "temperature": 0.0}, "max_retries": 0,
            }],
            "loading_params": {
                "state_dir": "state", "num_shards": 1,
                "datasets": [{"path": str(data), "type": "jsonl", "output_dir": "out"}],
            },
            "processing_params": {
                "inputs": [{"name": "text", "key": "text"}],
                "outputs": [{"name": "summary", "prompt": "Summarise: {{ text }}"}],
            },
        }  # fmt: skip
        run_workflow(tmp_path, config)
        proc = run_workflow(tmp_path, config, "--report", "report.zip")
    finally:
        server.stop()
    assert proc.returncode == 0
    with zipfile.ZipFile(tmp_path / "report.zip") as z:
        names = z.namelist()
        assert "report/report.html" in names, names
        (html,) = [n for n in names if n.startswith("report/data/raw/") and n.endswith("/report.html")]
        (metrics,) = [n for n in names if n.startswith("report/data/raw/") and n.endswith("/metrics.json")]
        # the run's own report and metrics, as the run wrote them, with their captions
        assert z.read(html) == (tmp_path / "state" / "report.html").read_bytes()
        assert json.loads(z.read(metrics))["aggregate"]["completed_shards"] == 1
        page = z.read("report/report.html").decode()
    assert "Run metrics" in page and "Numbers in the report" in page
