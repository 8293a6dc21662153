"""`python -m nanoserve.model.kernels`: build the kernels now (make setup does), not at the first engine start."""

import logging

from nanoserve.model.kernels import cpu_kernels

logging.basicConfig(level=logging.INFO)
print("C++ CPU kernels:", "ready" if cpu_kernels() else "unavailable (PyTorch ops)")
