"""Handing runs to a cluster's own scheduler (SLURM): the sbatch script and the commands."""
