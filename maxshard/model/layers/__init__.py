"""Flax Linen layers. Kernels carry logical axis names; activations are pinned with `sharding.constrain`."""
