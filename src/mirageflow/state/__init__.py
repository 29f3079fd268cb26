"""The state contract: what a pipeline keeps in its state directory, and what it means.

- ``layout``: every path of a state_dir (and a shard's output directory); the rules, the
  jobs, the CLI and the report take their paths from it.
- ``records``: the state files' shapes (status, failure, progress, lease, stats) and the
  one ``read`` that validates a file and says why it is damaged.
- ``shards``: the shard state machine (done / running / failed / pending; stale status.json
  files of an earlier config are not done): the one answer to "is this shard done?".
- ``pipeline``: stored configs, the records fingerprint, output_dir owners, derived outputs.
"""
