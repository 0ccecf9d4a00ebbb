"""Kernels by platform: `cpu/` (native C++ kernels, built once per machine,
and what they need of the CPU), `triton/` (GPU kernels, imported only where
a CUDA device is used)."""
