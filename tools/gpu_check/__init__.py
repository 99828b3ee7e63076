"""The GPU check: one command of at most 420 s on an H200 lease (``scripts/gpu_check.sh``).

plan:        the steps, their time boxes, what travels, the device tool's ``run`` call.
backends:    our backends by flat name and how each is asked for (``backend_request``).
driver:      runs the steps under ``timeout -k``; the JSON summary and the log tarball.
environment, smoke, sanitize, launches: the GPU jobs' own modules.
build:       ``_C`` with CMake for one Python (the preparation; the fallback on the device).
prepare:     checks what the preparation made and prints the ``run`` call.
"""
