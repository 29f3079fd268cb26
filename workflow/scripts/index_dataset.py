# Snakemake script: the logic lives in mirageflow.jobs. The guard keeps engines that
# spawn subprocesses (SGLang) from re-running this file in their children.
if __name__ == "__main__":
    from mirageflow import jobs

    jobs.index_dataset(snakemake)  # noqa: F821 - injected by Snakemake
