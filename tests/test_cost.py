"""Cost in dollars and a budget that holds (issue 38): backend openai against the stand-in
provider (tests/fakes/fake_http.py), which reports each answer's usage. The dollars a shard
records equal the provider's usage at the configured price, computed by hand; a run stopped by
execution_params.max_cost_usd keeps its answers and, rerun with a raised cap, asks the provider
nothing twice; ``mmirage check`` refuses a run whose forecast passes the cap."""

from __future__ import annotations

import json
import time

import pytest
from fakes.configs import pipeline_config
from fakes.fake_http import Behaviour, FakeServer

from mirageflow.config import load_config
from mirageflow.report.aggregate import compute_metrics
from mirageflow.shard.runner import index_datasets, run_shard
from mirageflow.stats.pricing import processor_price, table_price, unpriced_warnings
from mirageflow.transport.http_client import Response
from mirageflow.transport.rate_limit import RateLimiter, RateLimits

pytestmark = pytest.mark.usefixtures("no_proxy")

ROWS = 10


@pytest.fixture
def provider():
    server = FakeServer(Behaviour()).start()
    yield server
    server.stop()


def config(tmp_path, server, pricing: dict, execution: dict | None = None, max_new_tokens: int = 5) -> dict:
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"q": f"passage number {i}"}) + "\n" for i in range(ROWS)))
    return pipeline_config(
        data, state_dir=tmp_path / "state", output_dir=tmp_path / "out",
        processor={"backend": "openai", "base_url": server.url + "/v1", "model": "m", "max_retries": 0, "pricing": pricing,
                   "default_sampling_params": {"max_new_tokens": max_new_tokens}},
        dataset={"type": "jsonl", "output_format": "jsonl"},
        shard_params={"max_error_rate": 1.0, "checkpoint_rows": 1, "checkpoint_min_seconds": 0, "max_inflight": 1},
        execution_params=execution or {},
    )  # fmt: skip


def test_the_dollars_are_the_providers_usage_at_the_price(provider, tmp_path, capsys):
    raw = config(tmp_path, provider, {"input_per_million": 2.5, "output_per_million": 10.0})
    cfg = load_config(raw)
    index_datasets(cfg)
    status = run_shard(cfg, 0)
    # by hand: what the provider counted, at $2.50 and $10 per million tokens
    expected = (provider.prompt_tokens * 2.5 + provider.generation_tokens * 10.0) / 1_000_000
    assert provider.prompt_tokens and provider.generation_tokens
    assert status["stats"]["cost_usd"] == pytest.approx(expected, rel=1e-12)
    assert status["stats"]["unpriced_tokens"] == 0
    agg = compute_metrics(cfg.state_dir, 1, n_samples=1)["aggregate"]
    assert agg["cost_usd"] == pytest.approx(expected, rel=1e-12)
    assert agg["cost_forecast_usd"] == pytest.approx(expected, rel=1e-12)  # every row done: the forecast is the spend
    assert agg["cost_forecast_basis"] == f"from {ROWS} rows done"
    from mirageflow import cli

    summary = cli.status_summary(cfg)  # mmirage status
    assert (summary["cost_usd"], summary["cost_forecast_usd"]) == (pytest.approx(expected), pytest.approx(expected))
    (tmp_path / "pipeline.yaml").write_text(json.dumps(raw))
    assert cli.main(["status", "--config", str(tmp_path / "pipeline.yaml")]) == cli.EXIT_OK
    assert f"spent ${expected:,.2f}; forecast ~${expected:,.2f} for the run (from {ROWS} rows done)" in capsys.readouterr().out


def test_a_self_hosted_model_costs_its_gpu_hours_at_gpu_hour_usd(provider, tmp_path, monkeypatch):
    """An openai backend at 127.0.0.1 is a server of ours: its tokens are free, its 2 GPUs' hours cost $3.60 each."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    cfg = load_config(config(tmp_path, provider, {"gpu_hour_usd": 3.6}))
    index_datasets(cfg)
    st = run_shard(cfg, 0)["stats"]
    assert st["num_gpus"] == 2 and st["gpu_seconds_allocated"] > 0
    assert st["cost_usd"] == pytest.approx(st["gpu_seconds_allocated"] * 3.6 / 3600, rel=1e-9)


def test_cached_input_tokens_are_priced_apart_and_the_batch_price_is_the_tables():
    cached = Response(
        200, {}, json.dumps({"usage": {"prompt_tokens": 1000, "completion_tokens": 10, "prompt_tokens_details": {"cached_tokens": 600}}}).encode()
    )  # fmt: skip
    from mirageflow.stats.pricing import Price
    from mirageflow.transport.spend import answer_cost

    price = Price(2.0, 0.5, 8.0, "test")
    assert answer_cost(price, cached) == pytest.approx((400 * 2.0 + 600 * 0.5 + 10 * 8.0) / 1_000_000)
    raw = pipeline_config("in.jsonl", processor={"type": "batch_api", "provider": "openai", "model": "gpt-4o-mini"})
    del raw["processors"][0]["server_args"]
    raw["processing_params"]["outputs"][0]["type"] = "batch_api"
    batch = load_config(raw, check_paths=False).processors["batch_api"]
    assert processor_price(batch).output_per_million == pytest.approx(
        table_price("gpt-4o-mini", "openai", None, False).output_per_million / 2
    )
    local = load_config(
        pipeline_config("in.jsonl", processor={"backend": "openai", "base_url": "http://127.0.0.1:1/v1"}), check_paths=False
    )
    assert processor_price(local.processors["llm"]).output_per_million == 0.0  # a server of ours
    hosted = load_config(
        pipeline_config(
            "in.jsonl", processor={"backend": "openai", "base_url": "https://user:hunter2@api.example.com/v1?key=k3y", "model": "no-such-model"}
        ),
        check_paths=False,
    )  # fmt: skip
    assert processor_price(hosted.processors["llm"]) is None  # unknown, not 0
    custom = pipeline_config(
        "in.jsonl", processor={"type": "custom", "script_path": "f.py", "function_name": "f", "pricing": {"input_per_million": 1}}
    )
    del custom["processors"][0]["server_args"]
    with pytest.raises(Exception, match=r"processors\[0\]\.pricing: only model processors"):
        load_config(custom, check_paths=False)
    (warning,) = unpriced_warnings(hosted.processors)  # what mmirage check prints
    assert "no price known for model 'no-such-model'" in warning and "processors[].pricing" in warning
    assert "hunter2" not in warning and "k3y" not in warning and "api.example.com" in warning  # the URL's secrets masked


@pytest.mark.parametrize("inflight", [1, 4])
def test_the_budget_stops_the_spending_and_a_raised_cap_resumes_asking_nothing_twice(provider, tmp_path, inflight):
    # $1 per output token, input free: a request holds $5 (its max_new_tokens) before it goes and
    # costs its answer's 1-5 tokens; a $12 cap lets requests go while the spend is at most $7 (with
    # 4 in flight, a request waits for the others' answers while their holds leave no room)
    pricing = {"input_per_million": 0, "output_per_million": 1_000_000}
    raw = config(tmp_path, provider, pricing, {"max_cost_usd": 12})
    raw["shard_params"]["max_inflight"] = inflight
    cfg = load_config(raw)
    index_datasets(cfg)
    with pytest.raises(Exception, match=r"max_cost_usd.*cap \$12\.0000.*raise execution_params\.max_cost_usd and rerun"):
        run_shard(cfg, 0)
    failure = json.loads((tmp_path / "state" / "shard_0" / "failure.json").read_text())
    assert failure["failure_class"] == "budget_exceeded"
    asked = [r["body"]["messages"][-1]["content"] for r in provider.records]
    spent = json.loads((tmp_path / "state" / "spend.json").read_text())["spent_usd"]
    assert 0 < len(asked) < ROWS
    assert spent == provider.generation_tokens and 7 < spent <= 12  # the ledger holds what the provider counted, under the cap
    assert failure["stats"]["cost_usd"] == pytest.approx(spent)

    raw["execution_params"]["max_cost_usd"] = 1000
    status = run_shard(load_config(raw), 0)
    asked_again = [r["body"]["messages"][-1]["content"] for r in provider.records[len(asked) :]]
    assert sorted(asked + asked_again) == sorted(f"passage number {i}" for i in range(ROWS))  # each row asked once
    assert status["stats"]["rows_processed"] == ROWS
    assert status["stats"]["cost_usd"] == pytest.approx(provider.generation_tokens)  # both attempts'


def test_anthropics_rate_limit_headers_hold_the_pace_back(tmp_path):
    shared = tmp_path / "llm.json"
    limiter = RateLimiter(RateLimits(requests_per_minute=6000), shared)
    reset = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 30))
    headers = {"anthropic-ratelimit-requests-remaining": "0", "anthropic-ratelimit-requests-reset": reset}
    limiter.settle(None, Response(200, headers, b"{}"))
    until, _, next_slot = json.loads(shared.read_text())["requests_headers"]
    assert 28 < until - time.time() <= 30 and next_slot == until
    limiter.close()


def test_check_and_preview_forecast_the_whole_dataset_and_check_refuses_one_past_the_cap(provider, tmp_path, monkeypatch, capsys):
    """10 rows, each request estimated at its max_new_tokens (5) x $1 (input free): ~$50 for the dataset."""
    import yaml

    from mirageflow import cli

    raw = config(tmp_path, provider, {"input_per_million": 0, "output_per_million": 1_000_000}, {"max_cost_usd": 20})
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.delenv("MIRAGEFLOW_ALLOW_OVER_BUDGET", raising=False)
    assert cli.main(["preview", "--config", str(path)]) == cli.EXIT_OK
    assert "cost forecast for the whole dataset: ~$50.00 (from 3 rows previewed)" in capsys.readouterr().out
    assert cli.main(["check", "--config", str(path)]) == cli.EXIT_USAGE
    refused = capsys.readouterr().err
    assert "execution_params.max_cost_usd: the run is forecast to cost ~$50.00 (from 3 rows previewed" in refused
    assert "over the cap of $20.00: raise max_cost_usd, or set execution_params.allow_over_budget: true" in refused
    monkeypatch.setenv("MIRAGEFLOW_ALLOW_OVER_BUDGET", "1")
    assert cli.main(["check", "--config", str(path)]) == cli.EXIT_OK
    assert "~$50.00 (from 3 rows previewed); execution_params.max_cost_usd $20.00: the forecast passes it" in capsys.readouterr().out
    assert provider.records == []  # nothing was sent


def test_the_canary_spends_from_the_runs_budget(provider, tmp_path):
    """The canary runs in a state_dir of its own; its requests count in the run's ledger."""
    from mirageflow.shard.canary import run_canary

    raw = config(tmp_path, provider, {"input_per_million": 0, "output_per_million": 1_000_000}, {"max_cost_usd": 1000, "canary_rows": 3})
    cfg = load_config(raw)
    index_datasets(cfg)
    run_canary(cfg, tmp_path / "state" / "canary" / "verdict.json")
    assert len(provider.records) == 3
    assert json.loads((tmp_path / "state" / "spend.json").read_text())["spent_usd"] == provider.generation_tokens


def test_the_holds_of_a_killed_process_do_not_hold_the_budget(tmp_path):
    """A shard killed with requests in flight leaves their holds in the ledger: a process of this
    machine that is gone holds nothing, so the next one's request goes at once."""
    import asyncio
    import socket
    import subprocess
    import sys

    from mirageflow.stats.pricing import Price
    from mirageflow.transport.spend import SpendLedger

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    ledger_file = tmp_path / "spend.json"
    ledger_file.write_text(json.dumps({"spent_usd": 2.0, "holds": {f"{socket.gethostname()}:{dead}": [7.0, time.time()]}}))
    ledger = SpendLedger(ledger_file, 10.0, Price(0, 0, 1_000_000, "test"), stale_seconds=3600)
    assert asyncio.run(asyncio.wait_for(ledger.reserve(5.0), 5)) == 5.0  # $2 + $5 fit once the dead $7 is dropped
    assert json.loads(ledger_file.read_text())["holds"] == {ledger.holder: [5.0, pytest.approx(time.time(), abs=5)]}
    ledger.close()


def test_the_dag_build_refuses_a_run_forecast_past_the_cap_unless_allowed(provider, tmp_path):
    """`snakemake -n` validates as `mmirage check` does: ~$50 forecast, $20 cap."""
    import os

    from conftest import run_workflow, shard_jobs

    raw = config(tmp_path, provider, {"input_per_million": 0, "output_per_million": 1_000_000}, {"max_cost_usd": 20})
    refused = run_workflow(tmp_path, raw, "-n", check=False, env={**os.environ, "MIRAGEFLOW_ALLOW_OVER_BUDGET": ""})
    assert refused.returncode != 0 and "execution_params.max_cost_usd: the run is forecast to cost ~$50.00" in refused.text
    allowed = run_workflow(tmp_path, raw, "-n", env={**os.environ, "MIRAGEFLOW_ALLOW_OVER_BUDGET": "1"})
    assert shard_jobs(allowed) == 1
    assert provider.records == []
