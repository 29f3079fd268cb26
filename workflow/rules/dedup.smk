# Exact and near-duplicate removal after the merge (deduplication_params, mirageflow/data/dedup.py):
# <output_dir>/deduplicated/, the counts and the list of removed records. In the default
# target only when deduplication_params.enabled (default_targets in common.smk).


rule dedup:
    input:
        f"{STATE_DIR}/merged/dataset_{{ds}}.json",
        # no file: deduplication_params changed, it runs again whatever the rerun triggers
        changed=dedup_changed,
    output:
        counts=f"{STATE_DIR}/dedup/dataset_{{ds}}.json",
        removed=f"{STATE_DIR}/dedup/dataset_{{ds}}.removed.jsonl",
    log:
        f"{STATE_DIR}/logs/dedup_{{ds}}.log",
    localrule: True
    conda:
        "../../environment.yaml"
    resources:
        job_config=JOB_CONFIG,
    shell:
        "python -m mirageflow.jobs --config {resources.job_config:q} --log {log:q} dedup {wildcards.ds} {output.counts:q} {output.removed:q}"
