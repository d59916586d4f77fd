"""Running maxshard on many hosts: joining processes (`distributed`), submitting GKE workloads (`xpk`) and SLURM
jobs (`slurm`).

`python -m maxshard.launch xpk ...` prints (or runs) the `xpk workload create` command for a target topology;
`topologies` knows what each target holds. Importing this package imports no JAX.
"""
