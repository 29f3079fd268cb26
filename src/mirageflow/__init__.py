"""mirageflow: reformat and augment datasets with LLMs, shard by shard, as a Snakemake workflow."""

__version__ = "0.1.0"
