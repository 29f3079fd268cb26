# Index each dataset once (row count + where each shard starts); merge shard outputs.


rule index_dataset:
    input:
        dataset_files,
    output:
        f"{STATE_DIR}/datasets/dataset_{{ds}}.index.json",
    log:
        f"{STATE_DIR}/logs/index_dataset_{{ds}}.log",
    conda:
        "../../environment.yaml"
    resources:
        # Light: 1 CPU, no GPU (account/partition/qos from execution_params).
        **cluster_resources("index"),
    script:
        "../scripts/index_dataset.py"


rule merge:
    input:
        status_files(),
    output:
        f"{STATE_DIR}/merged/dataset_{{ds}}.json",
    log:
        f"{STATE_DIR}/logs/merge_{{ds}}.log",
    localrule: True
    conda:
        "../../environment.yaml"
    script:
        "../scripts/merge_dataset.py"
