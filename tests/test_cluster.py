"""SLURM resources from execution_params (mirageflow.cluster.resources), and their checks in load_config."""

from __future__ import annotations

import math

import pytest
from fakes.configs import pipeline_config

from mirageflow.cluster import node_span
from mirageflow.cluster import resources as cluster
from mirageflow.config import ConfigError, load_config


@pytest.fixture
def cfg(tmp_path) -> dict:
    data = tmp_path / "in.jsonl"
    data.write_text('{"q": "x"}\n')
    return pipeline_config(
        data,
        state_dir=None,
        output_dir=tmp_path / "out",
        num_shards=None,
        dataset={"type": "jsonl"},
        processor={"server_args": {"model_path": "org/model", "tp_size": 2, "dp_size": 2}},
    )


def resources(cfg: dict, job: str = "shard", **ep) -> dict:
    cfg["execution_params"] = ep
    return cluster.cluster_resources(load_config(cfg, environ={}), job)


def problems(cfg: dict, **ep) -> list[str]:
    cfg["execution_params"] = ep
    with pytest.raises(ConfigError) as err:
        load_config(cfg, environ={})
    return err.value.problems


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "limit, minutes",
    [
        ("00:00:01", 1),
        ("00:30:00", 30),
        ("00:30:01", 31),
        ("11:59:59", 720),
        ("1-00:00:00", 1440),
        ("2-01:02:00", 2942),
        ("100:00:00", 6000),
    ],
)
def test_minutes_rounds_up(limit, minutes):
    assert cluster.minutes(limit) == minutes


@pytest.mark.parametrize("limit", ["12:00", "1:00:00:00", "00:60:00", "00:00:75", "abc", "", "1-2:00"])
def test_minutes_refuses_malformed(limit):
    with pytest.raises(ValueError):
        cluster.minutes(limit)


@pytest.mark.parametrize(
    "mem, mb", [("200G", 204800), ("200g", 204800), ("64000M", 64000), ("512", 512), (512, 512), ("1T", 1048576), ("1500K", 2)]
)
def test_mem_mb(mem, mb):
    assert cluster.mem_mb(mem) == mb


@pytest.mark.parametrize("mem", ["200GB", "1.5G", "-4G", "0", "G"])
def test_mem_mb_refuses_malformed(mem):
    with pytest.raises(ValueError):
        cluster.mem_mb(mem)


@pytest.mark.parametrize(
    "extra, what",
    [("--time=10", "runtime/time limit"), ("--exclusive -t 10", "runtime/time limit"), ("--mem 4G", "memory"),
     ("--gres=gpu:2", "generic resources (GRES)"), ("-A acc", "account"), ("--job-name=x", "job name"),
     ("--exclusive", None), ("--mail-type=FAIL --nice=7", None)],
)  # fmt: skip
def test_forbidden_slurm_option(extra, what):
    assert cluster.forbidden_slurm_option(extra) == what


def test_forbidden_options_match_the_slurm_plugin():
    validation = pytest.importorskip("snakemake_executor_plugin_slurm.validation")
    assert cluster.FORBIDDEN_SLURM_OPTIONS == validation.get_forbidden_slurm_options()


# --------------------------------------------------------------------------- validation: ConfigError with the key path


def test_max_time_limit_shorter_than_time_limit_is_a_config_error(cfg):
    (p,) = problems(cfg, time_limit="02:00:00", max_time_limit="01:00:00")
    assert p == "execution_params.max_time_limit: 01:00:00 is shorter than time_limit 02:00:00"


def test_forbidden_slurm_extra_is_a_config_error(cfg):
    (p,) = problems(cfg, slurm_extra="--exclusive --gres=gpu:2")
    assert p.startswith("execution_params.slurm_extra: sets the generic resources (GRES), which the workflow sets")


@pytest.mark.parametrize(
    "key, value",
    [("time_limit", "12:00"), ("time_limit", "00:75:00"), ("max_time_limit", "1:2:3"), ("mem", "200GB"), ("gres", "gpu a100")],
)
def test_malformed_values_are_config_errors_naming_the_key(cfg, key, value):
    found = problems(cfg, **{key: value})
    assert found and all(p.startswith(f"execution_params.{key}: ") for p in found), found


def test_every_problem_is_reported_at_once(cfg):
    found = problems(cfg, time_limit="02:00:00", max_time_limit="01:00:00", slurm_extra="--mem=1G")
    assert [p.split(":")[0] for p in found] == ["execution_params.max_time_limit", "execution_params.slurm_extra"]


# --------------------------------------------------------------------------- resources


def test_shard_resources_defaults(cfg):
    res = resources(cfg)
    runtime = res.pop("runtime")
    # tp_size x dp_size GPUs, 8 CPUs each; SIGTERM 5 minutes before the 12 h limit
    assert res == {"gpu": 4, "cpus_per_task": 32, "slurm_extra": "--signal=TERM@300"}
    assert [runtime(wildcards=None, attempt=a) for a in (1, 2, 3)] == [720, 1440, 2160]


def test_shard_resources_from_every_key(cfg):
    res = resources(
        cfg, account="a1", partition="gpu", qos="high", reservation="r", gpus=1, cpus_per_task=6, mem="64G",
        time_limit="01:00:00", max_time_limit="02:30:00", constraint="h100", slurm_extra="--exclusive",
    )  # fmt: skip
    runtime = res.pop("runtime")
    assert res == {
        "slurm_account": "a1", "slurm_partition": "gpu", "qos": "high", "gpu": 1, "cpus_per_task": 6,
        "mem_mb": 65536, "constraint": "h100", "slurm_extra": "--reservation=r --exclusive --signal=TERM@300",
    }  # fmt: skip
    assert [runtime(None, a) for a in (1, 2, 3)] == [60, 120, 150]


@pytest.mark.parametrize(
    "limit, seconds",
    [("00:01:00", 6), ("00:00:30", 6), ("00:10:00", 60), ("00:30:00", 180), ("00:50:00", 300), ("11:59:59", 300), ("2-00:00:00", 300)],
)
def test_shards_get_sigterm_before_their_time_limit(cfg, limit, seconds):
    """A tenth of the (first attempt's) limit, 5 s to 5 min: enough to commit and write failure.json."""
    assert resources(cfg, time_limit=limit)["slurm_extra"] == f"--signal=TERM@{seconds}"
    assert cluster.term_signal_seconds(0) == cluster.TERM_MIN_SECONDS


@pytest.mark.parametrize("extra", ["--signal=B:USR1@600", "--exclusive --signal TERM@30", "--signal=TERM"])
def test_the_users_own_signal_wins(cfg, extra):
    assert resources(cfg, slurm_extra=extra)["slurm_extra"] == extra


def test_no_signal_for_index_jobs(cfg):
    assert "slurm_extra" not in resources(cfg, "index")


def test_signal_is_allowed_by_the_slurm_plugin(cfg):
    validation = pytest.importorskip("snakemake_executor_plugin_slurm.validation")
    extra = resources(cfg, time_limit="00:10:00")["slurm_extra"]
    assert not [p for p in validation.get_forbidden_slurm_options() if __import__("re").search(p, extra)]


def test_gres_replaces_gpus_and_counts_them_for_cpus(cfg):
    res = resources(cfg, gres="gpu:a100:3")
    assert (res["gres"], res["cpus_per_task"], "gpu" in res) == ("gpu:a100:3", 24, False)


def test_cpu_only_job(cfg):
    res = resources(cfg, gpus=0)
    assert "gpu" not in res and res["cpus_per_task"] == 1 and res["slurm_extra"] == "--signal=TERM@300"


def test_index_jobs_are_light(cfg):
    res = resources(cfg, "index", account="a1", reservation="r", gpus=4, mem="64G", slurm_extra="--exclusive", time_limit="05:00:00")
    runtime = res.pop("runtime")
    assert res == {"slurm_account": "a1", "cpus_per_task": 1, "slurm_extra": "--reservation=r"}
    assert runtime(None, 1) == 60 and runtime(None, 3) == 180


def test_uncapped_runtime_grows_without_bound(cfg):
    runtime = resources(cfg, time_limit="00:10:00")["runtime"]
    assert runtime(None, 1000) == 10000 and not math.isinf(runtime(None, 1))


def test_unknown_job_kind(cfg):
    with pytest.raises(ValueError, match="job must be"):
        resources(cfg, "merge")


# --------------------------------------------------------------------------- local runs show local resources


def test_a_local_run_gets_only_the_resources_it_limits_and_a_cluster_run_all(cfg):
    cfg["execution_params"] = {"account": "a1", "partition": "gpu", "mem": "8G", "time_limit": "01:00:00"}
    pipeline = load_config(cfg, environ={})
    submitted = cluster.job_resources(pipeline, "shard", True, {"_cores", "_nodes"})
    request = cluster.cluster_resources(pipeline, "shard")
    assert submitted.pop("runtime")(None, 2) == request.pop("runtime")(None, 2) == 120
    assert submitted == request  # exactly the SLURM request, unchanged
    assert submitted["gpu"] == 4 and submitted["cpus_per_task"] == 32 and submitted["mem_mb"] == 8192
    assert cluster.job_resources(pipeline, "shard", False, {"_cores", "_nodes"}) == {}  # `snakemake --cores 1`
    assert cluster.job_resources(pipeline, "shard", False, {"_cores", "gpu"}) == {"gpu": 4}  # `--resources gpu=8`
    assert cluster.job_resources(pipeline, "index", False, {"_cores"}) == {}


SNAKEMAKE = "/usr/lib/python3/site-packages/snakemake/__main__.py"  # `python -m snakemake` as sys.argv[0]


@pytest.mark.parametrize(
    "argv, remote, submits",
    [
        ([SNAKEMAKE, "--cores", "1"], False, False),
        ([SNAKEMAKE, "--profile", "profiles/local"], False, False),
        ([SNAKEMAKE, "--cores", "1", "-n", "--resources", "gpu=2"], False, False),
        ([SNAKEMAKE, "--profile", "profiles/slurm", "-n"], False, True),  # a dry run shows what would be submitted
        (["/venv/bin/snakemake", "--profile", "profiles/slurm", "--configfile", "my.yaml"], False, True),
        ([SNAKEMAKE, "--executor", "slurm", "--jobs", "4"], False, True),
        ([SNAKEMAKE, "--executor", "slurm-jobstep", "--cores", "1"], True, True),  # the job inside a SLURM job
        (["/usr/bin/pytest", "-q"], False, True),  # Snakemake's API in another program: the request is kept
    ],
)
def test_whether_a_run_submits_to_a_cluster_from_its_command_line(argv, remote, submits, monkeypatch):
    from types import SimpleNamespace

    from conftest import REPO

    from mirageflow.cluster.executor import submits_to_cluster

    monkeypatch.chdir(REPO)  # profiles/ relative to the checkout, as a user runs it
    monkeypatch.delenv("SNAKEMAKE_PROFILE", raising=False)
    assert submits_to_cluster(SimpleNamespace(remote_exec=remote), argv) is submits


def test_snakemake_profile_environment_variable_names_the_executor(monkeypatch):
    from types import SimpleNamespace

    from conftest import REPO

    from mirageflow.cluster.executor import submits_to_cluster

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("SNAKEMAKE_PROFILE", "profiles/slurm")
    assert submits_to_cluster(SimpleNamespace(remote_exec=False), [SNAKEMAKE, "-n"]) is True


# --------------------------------------------------------------------------- the driver's exit


def test_the_schedulers_rate_limit_timer_is_cancelled_when_the_run_ends():
    """Snakemake's own scheduler starts the timer (a non-daemon thread the interpreter would
    wait for at exit); cancelling it ends its thread now, and other timers are left alone."""
    import threading

    from snakemake.scheduling.job_scheduler import JobScheduler

    from mirageflow.cluster.snakemake_internals import cancel_scheduler_timers

    class Scheduler:  # the one attribute the real method uses
        _open_jobs = threading.Semaphore(0)

    before = set(threading.enumerate())
    JobScheduler._schedule_reevalutation(Scheduler(), 60)
    (timer,) = set(threading.enumerate()) - before
    assert isinstance(timer, threading.Timer) and not timer.daemon
    ours = threading.Timer(60, lambda: None)
    ours.start()
    try:
        assert cancel_scheduler_timers() == 1
        timer.join(10)
        assert not timer.is_alive()
        assert ours.is_alive()  # not Snakemake's scheduler's: untouched
        assert not Scheduler._open_jobs.acquire(blocking=False)  # cancelled, never fired
        assert cancel_scheduler_timers() == 0
    finally:
        ours.cancel()
        timer.cancel()


# --------------------------------------------------------------------------- Snakemake's internals, in one module

# what only Snakemake's internals offer (no plugin interface): read only in cluster/snakemake_internals.py
_INTERNALS = ("workflow.dag", "workflow.scheduler", "workflow.persistence", ".forcefiles", "snakemake.cli", "snakemake.shell",
              "snakemake.scheduling", "_unmark_incomplete", "scheduler.failed")  # fmt: skip


def test_snakemakes_internals_are_read_in_one_module_only():
    from conftest import REPO

    sources = [
        *(REPO / "src" / "mirageflow").rglob("*.py"),
        REPO / "Snakefile",
        REPO / "workflow" / "Snakefile",
        *(REPO / "workflow" / "rules").glob("*.smk"),
    ]
    found = [
        f"{path.relative_to(REPO)}: {name}"
        for path in sources
        if path.name != "snakemake_internals.py"
        for name in _INTERNALS
        if name in path.read_text()
    ]
    assert found == []


def test_another_snakemake_major_version_is_refused_with_one_message(monkeypatch):
    from types import SimpleNamespace

    import snakemake

    from mirageflow.cluster import snakemake_internals

    monkeypatch.setattr(snakemake_internals, "_checked", [])
    monkeypatch.setattr(snakemake, "__version__", "10.0.0")
    with pytest.raises(snakemake_internals.UnsupportedSnakemake, match=r"needs Snakemake 9\.x .* this is Snakemake 10\.0\.0"):
        snakemake_internals.force(SimpleNamespace(dag=SimpleNamespace(forcefiles=set())), "state/shard_0/status.json")


# --------------------------------------------------------------------------- one engine across nodes (cluster/node_span.py)


def span(cfg: dict, backend: str = "sglang_server", **server_args) -> dict:
    """``cfg`` with its processor on ``backend`` and these server_args (tp 4, dp 1 unless given)."""
    cfg["processors"][0]["backend"] = backend
    cfg["processors"][0]["server_args"] = {"model_path": "org/model", "tp_size": 4, "dp_size": 1, **server_args}
    if backend == "openai":
        cfg["processors"][0]["base_url"] = "http://llm:8000/v1"
    return cfg


@pytest.mark.parametrize(
    "ep, server_args",
    [
        ({"nodes": 2, "gpus": 2}, {}),  # 2 nodes x 2 GPUs = tp 4
        ({"nodes": 2}, {"tp_size": 8}),  # gpus unset: 8 / 2 per node
        ({"nodes": 2, "gres": "gpu:h100:4"}, {"extra_engine_args": {"pp_size": 2}}),  # tp 4 x pp 2 = 2 x 4
        ({"nodes": 4, "gpus": 4}, {"dp_size": 2, "tp_size": 4, "extra_engine_args": {"pipeline_parallel_size": 2}}),
    ],
)
@pytest.mark.parametrize("backend", ["sglang_server", "vllm_server"])
def test_an_engine_across_nodes_loads_when_its_gpus_are_every_gpu_of_every_node(cfg, ep, server_args, backend):
    assert load_config(span(cfg, backend, **server_args) | {"execution_params": ep}, environ={}).execution.nodes == ep["nodes"]


def test_pipeline_parallel_size_is_read_under_either_engines_name():
    assert [node_span.pipeline_parallel(a) for a in ({}, {"pp_size": 2}, {"pipeline_parallel_size": 4}, {"pp_size": None})] == [1, 2, 4, 1]


def test_gpus_of_the_nodes_must_be_the_engines(cfg):
    found = problems(span(cfg), nodes=2, gpus=4)  # 2 x 4 = 8 GPUs, tp 4
    assert found == [
        "processors[0].server_args: tp_size 4 x pp_size 1 x dp_size 1 = 4 GPUs, but execution_params.nodes x gpus = 2 x 4 = 8 "
        "(with nodes > 1, gpus counts the GPUs of each node); they must be equal"
    ]
    assert "execution_params.nodes x gres = 2 x 1" in problems(span(cfg), nodes=2, gres="gpu:a100:1")[0]
    assert problems(span(cfg), nodes=3)[0].startswith(
        "execution_params.gpus: tp_size 4 x pp_size 1 x dp_size 1 = 4 GPUs do not divide over nodes: 3"
    )


@pytest.mark.parametrize("backend", ["transformers", "openai", "auto", "sglang"])
def test_backends_that_cannot_span_nodes_are_refused_by_name(cfg, backend):
    found = problems(span(cfg, backend), nodes=2, gpus=2)
    assert len(found) == 1 and found[0].startswith(f"processors[0].backend: '{backend}' cannot span nodes")
    assert "only sglang_server and vllm_server can" in found[0]


def test_a_batch_api_pipeline_cannot_span_nodes(cfg):
    cfg["processors"] = [{"type": "batch_api", "provider": "openai", "model": "gpt-x", "api_key_env": "K"}]
    cfg["processing_params"]["outputs"][0]["type"] = "batch_api"
    found = problems(cfg, nodes=2)
    assert any(p.startswith("processors[0].backend: 'batch_api' cannot span nodes") for p in found), found


def test_shared_engines_and_a_null_tp_size_are_refused_across_nodes(cfg):
    found = problems(span(cfg, tp_size=None), nodes=2, gpus=2, shards_per_engine=3)
    assert found[0].startswith("execution_params.shards_per_engine: 3 shares an engine service over localhost on one node")
    assert found[1].startswith("processors[0].server_args.tp_size: null (the GPUs the job holds) is not allowed")


def test_one_node_keeps_its_meaning(cfg):
    """nodes 1 (the default) is checked as before: tp x dp GPUs of one node, any backend."""
    assert load_config(span(cfg, "transformers") | {"execution_params": {"gpus": 4}}, environ={}).execution.nodes == 1


def test_a_job_across_nodes_asks_slurm_for_the_nodes_and_the_gpus_of_each(cfg):
    res = resources(span(cfg, tp_size=8), nodes=2, mem="200G", account="a1", time_limit="01:00:00")
    res.pop("runtime")
    # gres (per node), never gpu (--gpus is the job's total, and the plugin's job step would ask rank 0's
    # one-node step for all of it); CPUs and memory per node; one task per node
    assert res == {
        "slurm_account": "a1", "nodes": 2, "gres": "gpu:4", "cpus_per_task": 32, "mem_mb": 204800,
        "slurm_extra": "--ntasks-per-node=1 --signal=TERM@300",
    }  # fmt: skip
    assert resources(span(cfg), "canary", nodes=2, gres="gpu:h100:2")["gres"] == "gpu:h100:2"
    index = resources(span(cfg), "index", nodes=2, gpus=2)
    assert "nodes" not in index and "gres" not in index  # the index job reads the dataset on one node
    assert cluster.shard_gpus(load_config(span(cfg, tp_size=8) | {"execution_params": {"nodes": 2}}, environ={})) == 4


def test_the_job_across_nodes_is_submitted_as_the_plugin_writes_it(cfg, tmp_path):
    """The plugin's own sbatch line for these resources: --nodes, per-node --gres, no --gpus, no --ntasks."""
    submit = pytest.importorskip("snakemake_executor_plugin_slurm.submit_string")
    from types import SimpleNamespace

    res = resources(span(cfg, tp_size=8), nodes=2, time_limit="01:00:00")
    res["runtime"] = res["runtime"](None, 1)

    class Resources(dict):
        __getattr__ = dict.__getitem__

    job = SimpleNamespace(resources=Resources(res), threads=1, name="shard", is_group=lambda: False)
    params = {"run_uuid": "u", "slurm_logfile": str(tmp_path / "l"), "comment_str": "c", "account": "", "partition": "", "workdir": None}
    call = submit.get_submit_command(job, params) + pytest.importorskip("snakemake_executor_plugin_slurm.utils").set_gres_string(job)
    assert "--nodes=2" in call and "--gres=gpu:4" in call and "--ntasks-per-node=1" in call and "--cpus-per-task=32" in call
    assert "--gpus" not in call and "--ntasks=" not in call and "--ntasks-per-gpu" not in call
    validation = pytest.importorskip("snakemake_executor_plugin_slurm.validation")
    assert not [p for p in validation.get_forbidden_slurm_options() if __import__("re").search(p, res["slurm_extra"])]
    # the job step the plugin runs the shard in (srun -n1 ...): no --gpus (it gets the job's gres on its
    # node), so the engine's rank 0 holds the first node's GPUs; srun places 1 task on 1 node
    jobstep = pytest.importorskip("snakemake_executor_plugin_slurm_jobstep")
    assert jobstep.get_gpu_setting(job) == "" and jobstep.get_node_setting(job) == "--nodes=2"
