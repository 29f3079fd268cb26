# Exact and near-duplicate removal after the merge (deduplication_params, mirageflow/data/dedup.py),
# in stages of parallel jobs, each holding a bounded share of the data (data/dedup_stages.py):
#   dedup_signatures  job k of P: MinHash signatures of the merged parts k, k+P, ..., and their
#                     class and band entries sorted by partition
#   dedup_pairs       partition p of P: only p's entries of every job -> duplicate edges
#   dedup_decide      one job: every partition's edges -> the decisions (today's greedy rule):
#                     the removed rows and what each duplicates
#   dedup_write       job k of P: the merged parts k, k+P, ... without their removed records,
#                     into <output_dir>/.deduplicated.parts/, and a report (rows read = written
#                     + removed per part; the idents the removed list needs)
#   dedup             one job: the parts in place as <output_dir>/deduplicated/ (a rename), the
#                     counts and the list of removed records
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


rule dedup_decide:
    input:
        dedup_signature_metas,
        dedup_edge_files,
        changed=dedup_changed,
    output:
        str(STATE.dedup_decisions("{ds}")),
    log:
        str(STATE.log("dedup_decide_{ds}")),
    localrule: True
    conda:
        "../../environment.yaml"
    resources:
        job_config=JOB_CONFIG,
    shell:
        "python -m mirageflow.jobs --config {resources.job_config:q} --log {log:q} dedup-decide {wildcards.ds}"


rule dedup_write:
    input:
        str(STATE.merge_manifest("{ds}")),
        str(STATE.dedup_decisions("{ds}")),
        dedup_signature_metas,
        changed=dedup_changed,
    output:
        str(STATE.dedup_written("{ds}", "{job}")),
    log:
        str(STATE.log("dedup_write_{ds}_{job}")),
    conda:
        "../../environment.yaml"
    resources:
        **cluster_resources("index"),
        job_config=JOB_CONFIG,
    shell:
        "python -m mirageflow.jobs --config {resources.job_config:q} --log {log:q} dedup-write {wildcards.ds} {wildcards.job}"


rule dedup:
    input:
        str(STATE.merge_manifest("{ds}")),
        dedup_signature_metas,
        str(STATE.dedup_decisions("{ds}")),
        dedup_written_files,
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
