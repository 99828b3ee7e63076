"""The compiled CUDA kernel families, each a backend of its own
(:class:`~fp8_noncausal_attn.backends.protocol.Backend`): ``mma_sync`` (:mod:`.mma_sync`, the
portable family in the extension ``_C``, sm_89 and newer) and the CUTLASS-DSL families
``wgmma`` and ``tcgen05`` (:mod:`.dsl`: compiled, NEVER RUN ON HARDWARE, run only when named).
:mod:`.extension` loads ``_C``, whose split planner, split merge and cache write every family
shares.
"""
