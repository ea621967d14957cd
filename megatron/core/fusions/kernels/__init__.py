"""Our Triton kernels (forward and backward) behind ``megatron.core.fusions``; imported only when one runs.

Each module lists its kernels in ``AOT_SIGNATURES`` (kernel, argument types, constexpr values) so the tests can
compile every kernel ahead of time for real GPU targets without a GPU.
"""
