# The records fingerprint every shard reads (mirageflow/state/pipeline.py), where there is
# none yet; the driver keeps it current (onstart) and forces the shards it changes.


rule records_fingerprint:
    output:
        RECORDS_FINGERPRINT,
    log:
        str(STATE.log("records_fingerprint")),
    localrule: True
    conda:
        "../../environment.yaml"
    resources:
        job_config=JOB_CONFIG,
    shell:
        "python -m mirageflow.jobs --config {resources.job_config:q} --log {log:q} fingerprint {output:q}"
