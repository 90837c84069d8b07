"""Triton kernels we own (one file per kernel family). Importing a module here needs Triton;
callers fall back to the PyTorch reference paths when it is missing (CPU machines)."""
