"""The backends (SPEC §4): ``reference`` (PyTorch), ``triton/`` (Triton kernels) and ``cuda/``
(the compiled kernel families ``mma_sync``, ``wgmma``, ``tcgen05``). Each implements
:class:`.protocol.Backend`; :mod:`fp8_noncausal_attn.registry` lists them and chooses among
them. Nothing here imports the API layer.
"""
