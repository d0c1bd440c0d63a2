"""One torch thread per test process: `pytest -n 2` then uses both cores without contention."""

import torch

torch.set_num_threads(1)
