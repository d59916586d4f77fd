"""What every level reads: the model description (`ModelConfig`), the layer stacks it assembles, and the
tables of remat policies, attention implementations and pipeline schedules. Imports nothing above
the leaves (errors, units, devices), so the config, parallel, model and planning folders all sit on it."""
