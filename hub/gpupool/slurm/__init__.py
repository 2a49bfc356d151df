"""Everything that knows Slurm: gpupool on an HPC cluster Slurm runs.

On Slurm, Slurm allocates: it owns the GPUs (gres, shards, MIG types), the accounts, QOS and fair
share, and it cannot be told which GPU index to give. gpupool's ledger decides the node and the
count, submits with ``--nodelist`` and the gres, and *mirrors* what Slurm granted (the devices of
``squeue``'s ``gres_detail``); jobs submitted outside the hub are outside use. See docs/slurm.md.
"""
