"""The one HTTP layer of mirageflow: every module that speaks HTTP goes through it (the LLM
engines, the batch APIs, image generation, remote image inputs).

- ``http_client``: ``HTTPClient``, a keep-alive HTTP/1.1 client bound to one origin (scheme,
  host, port). Credentials (``credentials=``: an API key's header, whatever it is called)
  belong to that client and so reach that origin only; an API key takes precedence over
  userinfo in the base URL. Deadlines per request, a size cap per answer, URLs shown
  redacted (``display_url``).
- ``fetch``: a URL an answer names (a batch's results, an image's url, a remote image
  input) and every redirect target: fetched with a client of its own that carries no
  credentials, unless the URL is the configured origin itself (``get_url``).
- ``retry``: the one retry policy: which statuses are transient (``RETRY_STATUS``: retried
  with exponential backoff and jitter, Retry-After honoured, bounded by ``RetryPolicy``) and
  which are permanent (``PERMANENT_STATUS``: 401, 403, 404; never retried), classified in
  one place (``classify``), and the human part of an error answer (``error_message``).
- ``rate_limit``: the pace under a provider's limits (``RateLimiter``: requests and tokens
  per minute, shared by a run's shards through a locked file in the state dir, tightened by
  the provider's x-ratelimit-* headers and Retry-After); ``retry.with_retries`` waits for
  every attempt's slot, so retries are paced by the same budget.
- ``spend``: the run's budget in dollars (``SpendLedger``: execution_params.max_cost_usd,
  every shard's requests held against one ledger in the state dir); ``retry.with_retries``
  holds each attempt's estimate before it goes and raises ``BudgetExceeded`` past the cap.
- ``shared_state``: the locked JSON file both of them keep in the state dir.

Nothing here imports engines, prompts or imagegen: they all import it.
"""
