# mirageflow's workflow is workflow/Snakefile (where the Snakemake workflow catalog looks for
# it); this file is the checkout's entry, what `snakemake` in the checkout runs.
#
#   snakemake --cores 1                          # the demo pipeline in config/config.yaml
#   snakemake --cores 1 --configfile my.yaml     # exactly my.yaml's pipeline
#   snakemake --cores 1 --config stats=true      # GPU sampling on


include: "workflow/Snakefile"


# An included file cannot name the default target (Snakemake gives it back to the file that
# includes), so this one names it again: the targets of workflow/Snakefile's `rule all`.
rule checkout_all:
    default_target: True
    input:
        rules.all.input,
