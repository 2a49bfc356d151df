"""The Slurm tests' fixtures: real daemons (:mod:`tests.slurm_cluster`)."""

from tests.slurm_cluster import make_slurm_cluster, slurm_cluster  # noqa: F401 (fixtures)
