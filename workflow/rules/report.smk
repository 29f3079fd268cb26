# Gather every shard's stats into the metrics report.


rule aggregate:
    input:
        status_files(),
    output:
        metrics=f"{STATE_DIR}/metrics.json",
        summary=f"{STATE_DIR}/summary.md",
    log:
        f"{STATE_DIR}/logs/aggregate.log",
    localrule: True
    conda:
        "../../environment.yaml"
    script:
        "../scripts/aggregate.py"
