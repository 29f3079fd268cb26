"""The state directory of a pipeline: stored configs, the records fingerprint, output_dir owners, derived outputs."""
