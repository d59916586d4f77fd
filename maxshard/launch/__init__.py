"""Running maxshard on many hosts: joining processes (`distributed`) and submitting GKE workloads (`xpk`).

`python -m maxshard.launch xpk ...` prints (or runs) the `xpk workload create` command for a target topology;
`topologies` knows what each target holds. Importing this package imports no JAX.
"""
