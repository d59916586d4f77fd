"""Sampling from a trained checkpoint: the KV-cached prefill/decode engine (decode), token sampling (sampling) and
finding and restoring a run's parameters for inference (inference). The CLI is `maxshard.generate`."""
