"""The Triton backend: ``attention`` (the paged attention kernels and the backend contract) and
``cache`` (the cache-write kernel). Triton is imported only by the modules that launch it."""
