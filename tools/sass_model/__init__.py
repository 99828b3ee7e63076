"""Static SASS performance model of the attention kernels (a PREDICTION, never a measurement).

Reads the compiled cubins of the CUDA extension (and compiles the Triton drafter kernel for the
same targets), finds each attention kernel's main loop in its control-flow graph, counts
warp-instructions per pipe per byte of KV read, adds registers / shared memory / occupancy, and
predicts the fraction of HBM bandwidth an issue-slot model allows on H200 and B200. Every
hardware assumption lives in ``hardware.py`` with its public source.

Run ``python -m tools.sass_model --out DIR`` (see ``__main__.py``).
"""
