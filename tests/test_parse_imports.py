"""What the instant commands import: the Snakefile's parse (every `snakemake`, and every
cluster job re-parses it) and `mmirage check` import what they need, not the runner, the
engines, the driver's hooks (report.terminal: imported when a hook runs), tqdm, torch,
transformers or xgrammar. Import checks, not timings (the CPU times are in BENCHMARKS.md,
"Instant commands" and "Snakemake at scale"). jinja2 is not in the list: Snakemake imports
it itself (snakemake.report) before it reads the Snakefile, and the config's prompt
templates are parsed with it.

Each command runs in a process of its own that writes the names in ``sys.modules`` when it
exits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import REPO
from fakes.configs import pipeline_config

# never at parse or check: the shard job's (tqdm, the runner, the engines) and the engines' heavy imports
HEAVY = ("torch", "transformers", "xgrammar", "tqdm", "sglang", "vllm")
JOB_ONLY = ("mirageflow.shard.runner", "mirageflow.shard.rows", "mirageflow.engines.transformers_engine", "mirageflow.engines.http")
# the driver's hooks (the Snakefile imports them inside onstart/onsuccess/onerror) and the engine service
HOOKS_ONLY = (
    "mirageflow.report.terminal",
    "mirageflow.shard.progress",
    "mirageflow.cluster.engine_service",
    "mirageflow.transport.http_client",
)
# mirageflow's own modules at parse: 36 when this was written (config validation, state paths,
# cluster resources), 47 when the Snakefile imported report.terminal at its top, 66 when that
# pulled in the runner; room for a few more, not for the hooks' or the job's
MAX_PARSE_MODULES = 40

RECORDER = """
import atexit, json, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
if sys.argv[1] == "snakemake":
    from snakemake.cli import main
    sys.argv = sys.argv[1:]
    main()
else:
    from mirageflow.cli import main
    sys.exit(main(sys.argv[2:]))
"""


def _modules(tmp_path: Path, *argv: str) -> list[str]:
    out = tmp_path / "modules.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", RECORDER, str(out), *argv], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def _config(tmp_path: Path) -> Path:
    """A pipeline with nothing to inspect on this machine (a remote server), one JSON output with a response_prefix."""
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"q": f"row {i}"}) + "\n" for i in range(4)))
    raw = pipeline_config(
        data, state_dir=tmp_path / "state", output_dir=tmp_path / "out",
        outputs=[{"name": "a", "prompt": "{{ q }}", "output_type": "JSON", "output_schema": {"answer": "str", "score": "int"},
                  "response_prefix": '{"answer": '}],
        processor={"backend": "openai", "base_url": "http://127.0.0.1:9/v1"},
    )  # fmt: skip
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _offences(modules: list[str]) -> list[str]:
    return [m for m in modules if m.split(".")[0] in HEAVY or m in JOB_ONLY or m in HOOKS_ONLY]


def _check_parse(modules: list[str]) -> None:
    assert _offences(modules) == []
    ours = [m for m in modules if m.split(".")[0] == "mirageflow"]
    assert len(ours) <= MAX_PARSE_MODULES, ours


def test_the_snakefile_parse_imports_no_job_code(tmp_path):
    config = _config(tmp_path)
    modules = _modules(
        tmp_path, "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
        "--configfile", str(config), "--cores", "1", "-n", "-q",
    )  # fmt: skip
    _check_parse(modules)


def test_a_cluster_jobs_parse_imports_no_job_code(tmp_path):
    """The command a SLURM job runs for its shard (Snakemake's remote mode, as the executor
    writes it: scripts/bench/snakemake_scale.py JOB_ARGS), in a state_dir where the driver
    made what a shard needs; -n stops after the parse and the one-job DAG."""
    # the job's arguments from the benchmark that measures them (one copy), read in its folder
    read = [sys.executable, "-c", "import json, snakemake_scale; print(json.dumps(snakemake_scale.JOB_ARGS))"]
    JOB_ARGS = json.loads(subprocess.run(read, cwd=REPO / "scripts" / "bench", capture_output=True, text=True, check=True).stdout)

    from mirageflow.state.layout import StateLayout

    config = _config(tmp_path)
    state = StateLayout(tmp_path / "state")
    for made_by_the_driver in (state.dataset_index(0), state.dataset_offsets(0), state.fingerprint):
        made_by_the_driver.parent.mkdir(parents=True, exist_ok=True)
        made_by_the_driver.write_text("{}")
    modules = _modules(
        tmp_path, "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
        "--configfile", str(config), *JOB_ARGS,
    )  # fmt: skip
    _check_parse(modules)


def test_mmirage_check_validates_a_json_prefix_without_xgrammar(tmp_path):
    config = _config(tmp_path)
    modules = _modules(tmp_path, "mmirage", "check", "--config", str(config))
    assert _offences(modules) == []
