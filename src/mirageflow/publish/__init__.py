"""A run's records on the Hugging Face Hub, with a card that says how they were made.

- ``card``: the dataset card (README.md: the Hub's YAML header, then the pipeline, models,
  sampling, prompts and the run's figures, read from metrics.json), written beside
  merged/ by the card rule of every run that merges;
- ``hub``: ``mmirage publish`` and the publish rule: the records as Parquet and the card,
  uploaded with huggingface_hub (resumable), after the refusals (a run with shards not
  done, a repo another pipeline made).
"""
