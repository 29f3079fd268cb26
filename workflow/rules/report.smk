# Gather every shard's stats into the metrics report: metrics.json, summary.md and a
# self-contained report.html (plots embedded), also registered for `snakemake --report`.


rule aggregate:
    input:
        status_files(),
        # the dedup counts go into the report (none unless deduplication_params.enabled)
        dedup_count_files(),
        # no file: made again when a shard it was built from has no status file
        changed=derived_changed,
    output:
        metrics=report(
            str(STATE.metrics),
            caption="../report/metrics.rst",
            category="Run metrics",
        ),
        summary=str(STATE.summary),
        html=report(
            str(STATE.report_html),
            caption="../report/report.rst",
            category="Run metrics",
        ),
    log:
        str(STATE.log("aggregate")),
    localrule: True
    conda:
        "../../environment.yaml"
    resources:
        job_config=JOB_CONFIG,
    shell:
        "python -m mirageflow.jobs --config {resources.job_config:q} --log {log:q} aggregate"
