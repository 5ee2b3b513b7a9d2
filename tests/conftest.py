"""One torch thread per test process: on 2 shared cores more threads are 5-25x slower whenever
anything else runs (ENVIRONMENT.md), and timings stay comparable."""

import torch

torch.set_num_threads(1)
