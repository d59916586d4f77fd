"""The network apart from any run: `ModelConfig` (config), the Linen layers, the Transformer (transformer), the
remat policy table, quantization rules, which parameters train, and which attention kernel a device gets.

Empty on purpose: `maxshard.spec.model_config` and `maxshard.spec.remat` are imported by the run config, so importing
them must not pull in the layers."""
