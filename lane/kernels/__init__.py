"""GPU kernels of the lanes (CUDA C compiled by NVRTC, loaded as CuPy modules): one op a pair of files, its .cu
beside its Python wrapper and numpy reference; docs/layout.md lists them."""
