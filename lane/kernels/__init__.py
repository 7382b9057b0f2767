"""GPU kernels of the lanes (CuPy RawModule, CUDA C compiled by NVRTC): see experts.py."""
