"""Triton kernels (optional: ``triton`` ships with CUDA builds of torch; on CPU they run under its interpreter,
``TRITON_INTERPRET=1``, as the tests run them)."""
