"""The layers models are built of: CPU product dispatch (products, Linear),
RMSNorm, the fused elementwise ops, rotary embeddings, the quantized linears
and the native layer stack. Model families and loading live in
specpage.models, which imports this package; nothing here imports it.

This file imports nothing, so that a torch-free module may import a
torch-free layer type (rope_config.RopeConfig)."""
