"""A fresh start for every example, for sphinx-gallery's ``reset_modules``.

sphinx-gallery runs all examples in one process, so an example that changes the default dtype,
turns off gradients or sets a seed would otherwise leak that into the next one.
"""

import random

import torch

_DEFAULT_THREADS = torch.get_num_threads()


def reset_state(gallery_conf, fname):
    """Seeds, torch's global settings and matplotlib, as a fresh interpreter has them."""
    import matplotlib
    import matplotlib.pyplot as plt
    import numpy as np

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)  # seeds CUDA too
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(_DEFAULT_THREADS)
    torch.use_deterministic_algorithms(False)
    # PyTorch's defaults: no TF32 in matrix products, TF32 allowed in cuDNN convolutions.
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True
    plt.close("all")
    matplotlib.rcdefaults()
