"""Running on a cluster: SLURM resources, a shard's GPU claim, the time-limit signal, engine services."""
