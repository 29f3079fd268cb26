# The dataset card beside merged/ (every run that merges), and the upload to the Hugging
# Face Hub when execution_params.publish is set (mirageflow/publish/; default_targets in
# common.smk). Both run on the driver's machine: the login node has the network.


rule card:
    input:
        str(STATE.metrics),
        merge_manifests(),
        dedup_count_files(),
    output:
        dataset_cards(),
    log:
        str(STATE.log("card")),
    localrule: True
    conda:
        "../../environment.yaml"
    resources:
        job_config=JOB_CONFIG,
    shell:
        "python -m mirageflow.jobs --config {resources.job_config:q} --log {log:q} card"


rule publish:
    input:
        dataset_cards(),
        merge_manifests(),
        dedup_count_files(),
    output:
        str(STATE.publish_record),
    log:
        str(STATE.log("publish")),
    localrule: True
    conda:
        "../../environment.yaml"
    resources:
        job_config=JOB_CONFIG,
    shell:
        "python -m mirageflow.jobs --config {resources.job_config:q} --log {log:q} publish {output:q}"
