"""Orbax checkpoints: saving and restoring the train state (manager), reading parameters of a step (params), the
layout-independent tree names (layout), failure classification (health) and the raw item reader (orbax_io)."""
