# Exact and near-duplicate removal after the merge (deduplication_params, mirageflow/data/dedup.py):
# <output_dir>/deduplicated/, the counts and the list of removed records. In the default
# target only when deduplication_params.enabled (default_targets in common.smk).


rule dedup:
    input:
        str(STATE.merge_manifest("{ds}")),
        # no file: deduplication_params changed, it runs again whatever the rerun triggers
        changed=dedup_changed,
    output:
        counts=str(STATE.dedup_counts("{ds}")),
        removed=str(STATE.dedup_removed("{ds}")),
    log:
        str(STATE.log("dedup_{ds}")),
    localrule: True
    conda:
        "../../environment.yaml"
    resources:
        job_config=JOB_CONFIG,
    shell:
        "python -m mirageflow.jobs --config {resources.job_config:q} --log {log:q} dedup {wildcards.ds} {output.counts:q} {output.removed:q}"
