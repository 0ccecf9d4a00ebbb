"""The paged-attention interface a model runs against, and its backends.

A forward carries a flattened batch: each sequence contributes a span of new
tokens (a prefill chunk, one decode token, or k + 1 verification tokens) whose
K/V are written into their slots before attention reads every sequence's
context through its block table, causal inside each span.

- `backend`: the `AttentionBackend` protocol, and `AttentionMetadata`, what
  every backend reads, with the span layout each backend builds its own from.
- `reference`: `TorchAttention`, the pure-torch reference (the CPU path).
- `triton`: `TritonAttention`, the kernels of `specpage.kernels` (the GPU path).
- `selection`: `select_backend`, the backend for a device.

Nothing is re-exported here, so importing the protocol or the reference does
not import triton, which only the GPU path needs.
"""
