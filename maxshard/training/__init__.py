"""The train state and its step: sharded init, jitted train/eval steps with gradient accumulation (step), the
optimizer (optim) and the loss (loss). Knows the model and the mesh; not how a run is loaded."""
