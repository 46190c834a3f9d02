"""Helpers shared by the test modules: stores, agents, trainer runs, the SLURM lab."""
