"""The backends (SPEC §4): ``reference`` (PyTorch), ``triton/`` (Triton kernels) and ``cuda/``
(the compiled kernel families). Each backend module implements the contract of
:class:`fp8_noncausal_attn.dispatch.Backend`; :mod:`fp8_noncausal_attn.dispatch` chooses among
them. Nothing here imports the API layer.
"""
