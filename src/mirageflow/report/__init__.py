"""What users read: the aggregate metrics, report.html, the terminal's live line and summary, SLURM accounting."""
