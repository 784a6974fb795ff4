"""@triton.jit kernels only (DESIGN.md §4). Import lazily: this package imports triton."""
