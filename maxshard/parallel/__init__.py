"""Where arrays live: mesh axis names, the physical mesh from the ici/dcn knobs, logical rules -> shardings, and the
pipeline's shape on that mesh. Knows the config, never the model."""
