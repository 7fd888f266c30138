"""A fresh start for every example, for sphinx-gallery's ``reset_modules``.

sphinx-gallery runs all examples in one process, so an example that changes the default dtype,
turns off gradients or sets a seed would otherwise leak that into the next one. So would
``torch.compile``: its caches are kept per code object, and every ``vmap``-wrapped function
shares one, so a function compiled at two batch sizes by one example made the next example's
compiled ``vmap`` start with a dynamic batch dimension, which a fresh process would not.
The same holds for the C heap: the examples ask glibc to keep freed memory, so after a page
that allocates gigabytes the build's process holds a large heap of free memory that a fresh
process (a reader's notebook) does not have. Handing it back to the kernel before each example
makes the next one start from a heap like a fresh process's.
"""

import ctypes
import gc
import platform
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
    torch.compiler.reset()  # compiled code and dynamo's shape history, as in a fresh process
    plt.close("all")
    matplotlib.rcdefaults()
    gc.collect()  # the last example's tensors, if a cycle still holds them
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        # Free heap pages go back to the kernel, as in a fresh process.
        ctypes.CDLL(None).malloc_trim(0)
