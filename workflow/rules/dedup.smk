# Exact and near-duplicate removal after the merge (deduplication_params, mirageflow/data/dedup.py),
# in stages of parallel jobs, each holding a bounded share of the data (data/dedup_stages.py):
#   dedup_signatures  job k of P: MinHash signatures of the merged parts k, k+P, ..., and their
#                     class and band entries sorted by partition
#   dedup_pairs       partition p of P: only p's entries of every job -> duplicate edges
#   dedup             every partition's edges -> the decisions (today's greedy rule), then
#                     <output_dir>/deduplicated/, the counts and the list of removed records
# P is dedup_partitions (one per 8 shards, at most 256). In the default target only when
# deduplication_params.enabled (default_targets in common.smk).


rule dedup_signatures:
    input:
        str(STATE.merge_manifest("{ds}")),
        # no file: deduplication_params changed, every stage runs again whatever the rerun triggers
        changed=dedup_changed,
    output:
        **{k: str(v) for k, v in STATE.dedup_signatures("{ds}", "{job}").items()},
    log:
        str(STATE.log("dedup_signatures_{ds}_{job}")),
    conda:
        "../../environment.yaml"
    resources:
        **cluster_resources("index"),
        job_config=JOB_CONFIG,
    shell:
        "python -m mirageflow.jobs --config {resources.job_config:q} --log {log:q} dedup-signatures {wildcards.ds} {wildcards.job}"


rule dedup_pairs:
    input:
        dedup_signature_files,
        changed=dedup_changed,
    output:
        str(STATE.dedup_edges("{ds}", "{partition}")),
    log:
        str(STATE.log("dedup_pairs_{ds}_{partition}")),
    conda:
        "../../environment.yaml"
    resources:
        **cluster_resources("index"),
        job_config=JOB_CONFIG,
    shell:
        "python -m mirageflow.jobs --config {resources.job_config:q} --log {log:q} dedup-pairs {wildcards.ds} {wildcards.partition}"


rule dedup:
    input:
        str(STATE.merge_manifest("{ds}")),
        dedup_signature_metas,
        dedup_edge_files,
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
