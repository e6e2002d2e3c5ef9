"""Suite-wide settings: one intra-op thread.

The test models are tiny; with two OpenMP threads on a 2-core machine every small op pays a fork/join and
spin-wait (measured ~5x slower per decode step here), so the suite runs single-threaded. Timings belong in
profiles/, not here.
"""

import torch

torch.set_num_threads(1)
