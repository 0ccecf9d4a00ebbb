"""Native CPU kernels: the C++ sources beside this file (package data), the
loader that builds them once per machine (`native`), the CPU's features
(`features`) and large tensors on huge pages (`hugepages`)."""
