"""What a processor's tokens cost in US dollars: the one price of each processor.

``processor_price(processor)`` says where the price comes from, in this order:

- ``processors[].pricing`` (``input_per_million``, ``cached_input_per_million``,
  ``output_per_million``): the user's own figures, for any model (a gateway's, a negotiated
  rate, a model the table does not know);
- a self-hosted model (an engine that loads it, a server launched by the job, backend
  ``openai`` at a loopback or private address): tokens cost nothing; its GPU-hours cost
  ``pricing.gpu_hour_usd`` when given (``gpu_cost``, over the GPU-hours the shard counts);
- a hosted model (backend ``openai`` at a public address, ``batch_api``): the
  `genai-prices` package's table (pydantic's, kept up to date from the providers' price
  pages), found by the model's name and the provider its base_url is (``provider_api_url``)
  or its batch provider; ``batch_api`` at the table's batch price (``processing: batch``:
  OpenAI's and Anthropic's 50 % batch discount as their price pages state it). Tiered prices
  (a long-context tier) are taken at their first tier;
- else the price is unknown (``None``): costs say "unknown", never 0, and ``mmirage check``
  warns.

A ``Price`` prices tokens: cached input tokens (OpenAI's ``prompt_tokens_details.cached_tokens``,
a part of the prompt's) at the cached price, the rest of the input at the input price.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

MILLION = 1_000_000


@dataclass(frozen=True)
class Price:
    """US dollars per million tokens, and where the figures come from (for the report)."""

    input_per_million: float
    cached_input_per_million: float
    output_per_million: float
    source: str

    def cost(self, input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> float:
        """Dollars of one answer's tokens (``cached_tokens``: the part of ``input_tokens`` read from the provider's cache)."""
        cached = min(max(0, cached_tokens), max(0, input_tokens))
        return (
            (input_tokens - cached) * self.input_per_million
            + cached * self.cached_input_per_million
            + output_tokens * self.output_per_million
        ) / MILLION


FREE = Price(0.0, 0.0, 0.0, "self-hosted")


def cached_prompt_tokens(usage) -> int:
    """The prompt tokens an OpenAI-style usage says came from the provider's cache
    (``prompt_tokens_details.cached_tokens``); 0 when it says nothing of them."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and cached > 0 else 0


def _self_hosted_url(base_url: str | None) -> bool:
    """A base_url on this machine or a private network: a server of ours, not a provider's."""
    host = urlsplit(base_url or "").hostname or ""
    if host in ("localhost", "") or host.endswith((".local", ".internal")):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return "." not in host  # a cluster node's short name
    return address.is_loopback or address.is_private or address.is_link_local


def is_hosted(processor) -> bool:
    """Whether a model processor's tokens go to a paid provider: a backend that sends them to a
    provider's API (its capability ``provider_api``: batch_api; openai), not at a self-hosted address."""
    from mirageflow.engines.registry import capabilities

    if not capabilities(processor.backend).provider_api:
        return False
    return processor.batch is not None or not _self_hosted_url(processor.base_url)


@lru_cache(maxsize=64)
def table_price(model: str, provider: str | None, base_url: str | None, batch: bool) -> Price | None:
    """The genai-prices table's price of ``model`` (None: the table does not know it)."""
    from genai_prices import Usage, calc_price

    kw = {"provider_id": provider} if provider else {"provider_api_url": base_url}
    context = {"processing": "batch"} if batch else None
    n = 1000  # a thousand tokens of each kind: inside every first price tier
    try:
        plain = calc_price(Usage(input_tokens=n, output_tokens=n), model_ref=model, price_context=context, **kw)
        cached = calc_price(Usage(input_tokens=n, cache_read_tokens=n), model_ref=model, price_context=context, **kw)
    except LookupError:
        return None
    scale = MILLION / n
    where = f"genai-prices {plain.provider.id}/{plain.model.id}" + (" (batch price)" if batch else "")
    return Price(float(plain.input_price) * scale, float(cached.input_price) * scale, float(plain.output_price) * scale, where)


def processor_price(processor) -> Price | None:
    """The price of a model processor's tokens (see the module's docstring); None: unknown."""
    pricing = processor.pricing or {}
    if pricing.get("input_per_million") is not None or pricing.get("output_per_million") is not None:
        given = float(pricing.get("input_per_million") or 0.0)
        return Price(
            given,
            float(pricing["cached_input_per_million"]) if pricing.get("cached_input_per_million") is not None else given,
            float(pricing.get("output_per_million") or 0.0),
            f"processors[{processor.index}].pricing",
        )
    if not is_hosted(processor):
        return FREE
    batch = processor.batch is not None  # a provider's batch API: its batch price
    provider = processor.batch.provider if batch else None
    model = processor.model or processor.server_args.model_path
    return table_price(model, provider, None if provider else processor.base_url, batch)


def gpu_hour_usd(processors) -> float | None:
    """Dollars per GPU-hour of a shard's GPUs: the largest ``pricing.gpu_hour_usd`` of its
    self-hosted processors (they share the job's GPUs); None when none gives one."""
    prices = [
        float(p.pricing["gpu_hour_usd"]) for p in processors if p.pricing and p.pricing.get("gpu_hour_usd") is not None and not is_hosted(p)
    ]
    return max(prices) if prices else None


def unpriced_warnings(processors: dict) -> list[str]:
    """One line per hosted processor whose price is unknown (``mmirage check`` shows them)."""
    from mirageflow.redact import redact_text

    out = []
    for name, p in processors.items():
        if processor_price(p) is not None:
            continue
        model = p.model or p.server_args.model_path
        where = redact_text(p.base_url) if p.base_url else p.backend  # a URL's password or query never printed
        out.append(
            f"processors[{p.index}] ({name}): no price known for model {model!r} at {where}; "
            "its cost shows as unknown and execution_params.max_cost_usd cannot hold it: "
            "set processors[].pricing.input_per_million and output_per_million"
        )
    return out
