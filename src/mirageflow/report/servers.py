"""The engines that ran and the inference servers' own figures in the report (metrics.json's
``per_shard[].engines`` / ``server_metrics`` and ``aggregate.inference_servers``, the
summary's "Inference servers" section): what vLLM's or SGLang's ``/metrics`` counted
(engines/server_metrics.py) beside our own counters."""

from __future__ import annotations

from mirageflow.numbers import fmt

# the packages whose version names an engine (EngineInfo.versions: the engine's, beside its client's)
ENGINE_PACKAGES = ("vllm", "sglang", "transformers")


def engines_ran(status: dict) -> dict[str, str]:
    """processor -> the engine that ran it, e.g. ``vllm_server (vllm 0.32.0)``; a served
    shard's engine is the service's."""
    out = {}
    for name, info in (status.get("engines") or {}).items():
        info = info or {}
        backend = str(info.get("backend") or "?")
        version = next((f"{k} {v}" for k, v in (info.get("versions") or {}).items() if k in ENGINE_PACKAGES), None)
        shared = " via engine service" if (info.get("details") or {}).get("shared_engine") else ""
        out[name] = backend + (f" ({version})" if version else "") + shared
    return out


def server_aggregate(statuses: list[dict]) -> dict | None:
    """The inference servers' own figures over the completed shards (each shard's last
    attempt; status.json ``server_metrics``), None when no engine read them."""
    figures = [f for s in statuses for f in (s.get("server_metrics") or {}).values() if isinstance(f, dict)]
    if not figures:
        return None

    def total(key: str) -> int | None:
        values = [f.get(key) for f in figures if f.get(key) is not None]
        return sum(values) if values else None

    queries, hits = total("prefix_cache_queries"), total("prefix_cache_hits")
    queues = [f["queue_length_max"] for f in figures if f.get("queue_length_max") is not None]
    tokens = [f.get("tokens") or {} for f in figures]
    notes = list(dict.fromkeys(t["note"] for t in tokens if t.get("note")))
    return {
        "engines": len(figures),
        "server_prompt_tokens": total("prompt_tokens"),
        "server_generation_tokens": total("generation_tokens"),
        "server_requests": total("requests"),
        "prefix_cache_hit_rate": hits / queries if queries and hits is not None else None,
        "queue_length_max": max(queues) if queues else None,
        "preemptions": total("preemptions"),
        "token_totals_reconciled": sum(1 for t in tokens if t.get("reconciled")),
        "token_notes": notes[:5],
    }


def summary_lines(servers: dict | None, cell) -> list[str]:
    """summary.md's section on the servers' figures ([] when none were read); ``cell``
    escapes a table-cell or list text."""
    if not servers:
        return []
    rate = servers.get("prefix_cache_hit_rate")
    lines = ["", "## Inference servers' own figures (their /metrics)", "",
             f"- prefix-cache hit rate: {'n/a' if rate is None else f'{100 * rate:.1f} %'}; longest queue: "
             f"{fmt(servers.get('queue_length_max'))}; preemptions: {fmt(servers.get('preemptions'))}",
             f"- prompt / generated tokens by the servers' counters: {fmt(servers.get('server_prompt_tokens'))} / "
             f"{fmt(servers.get('server_generation_tokens'))}; our totals reconciled with them for "
             f"{servers['token_totals_reconciled']} of {servers['engines']} engines"]  # fmt: skip
    return lines + [f"- {cell(note)}" for note in servers.get("token_notes") or []]
