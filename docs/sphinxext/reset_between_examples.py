"""A fresh start for every example, for sphinx-gallery's ``reset_modules``.

sphinx-gallery runs all examples in one process, so an example that changes the default dtype,
turns off gradients or sets a seed would otherwise leak that into the next one. So would
``torch.compile``: its caches are kept per code object, and every ``vmap``-wrapped function
shares one, so a function compiled at two batch sizes by one example made the next example's
compiled ``vmap`` start with a dynamic batch dimension, which a fresh process would not.
So would CUDA's caching allocator, which keeps freed blocks: on an H200, a page's check that
``torch.ones(2**20) + 1`` peaks at 8 MiB by ``torch.cuda.max_memory_allocated`` passed when it
ran after a page that had stopped early, and failed after the same page ran to its end
(probably because the allocator handed a whole cached block, larger than asked for, to a
request). So the cache is emptied before each example. Something similar holds for the C heap.
Some examples ask glibc, with ``mallopt``, to keep freed memory and to serve large blocks from
the heap, and those settings last for the rest of the process:
in the build, the Jacobians page (which set nothing then) ran its ``jacrev(jacfwd)`` Hessian
with no page faults per call, while a fresh run of its download mapped each 64 MiB block afresh
and took about 65,000 faults per call, and printed a time ratio to ``hessian`` several times
larger. So before each example the settings go back to those of a fresh process whose dynamic
thresholds have risen (glibc raises the mmap threshold to each freed mapped block, up to 32 MiB
on 64-bit systems, and the trim threshold to twice that; after a ``mallopt`` call they stay
fixed, so the ceiling is set here), and free heap pages go back to the kernel. That cannot undo
the heap's layout: free chunks that earlier examples left inside the heap still serve large
blocks without a new mapping. So an example whose times depend on the allocator pins its own
policy, as :doc:`/reading-timings` describes, and then a fresh run does what the build does.
"""

import ctypes
import gc
import platform
import random
import sys

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
    _forget_imported_mains()
    # Dynamo's first compile turns distributions' argument validation off for the whole process
    # (TorchPatcher in torch/_dynamo/eval_frame.py); a fresh interpreter starts with it on.
    torch.distributions.Distribution.set_default_validate_args(__debug__)
    plt.close("all")
    matplotlib.rcdefaults()
    gc.collect()  # the last example's tensors, if a cycle still holds them
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the CUDA allocator's free blocks: see the module's docstring
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        _reset_glibc_malloc(ctypes.CDLL(None))


def _forget_imported_mains():
    """Drop the references to earlier examples' ``__main__`` that dynamo left in torch's modules.

    To guard on a global of the user's module from a frame of torch's own (the wrapper that
    every ``vmap``- or ``grad``-ed function shares), dynamo imports that module once and for all
    (a ``functools.cache``) and stores it in the frame's globals as ``__import___main__``;
    ``torch.compiler.reset()`` clears neither. Each example runs in a ``__main__`` of its own, so
    the next example's guards would look up its names in an earlier example's module: "module
    '__main__' has no attribute ...", on the compile page after the pitfalls page. A fresh
    interpreter has one ``__main__`` and never meets this.
    """
    from torch._dynamo import symbolic_convert

    symbolic_convert._import_module.cache_clear()
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if isinstance(names, dict) and "__import___main__" in names:
            del names["__import___main__"]


# glibc's mallopt parameters (<malloc.h>) and the values a fresh 64-bit process works with.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -2, -3, -4
_MMAP_THRESHOLD_CEILING = 32 * 2**20  # DEFAULT_MMAP_THRESHOLD_MAX: 4 MiB * sizeof(long)


def _reset_glibc_malloc(libc):
    """Undo an earlier example's ``mallopt`` calls, then hand free heap pages back."""
    for parameter, value in [
        (_M_MMAP_MAX, 65536),  # large blocks may be mapped again (glibc's default)
        (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_CEILING),
        (_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD_CEILING),
        (_M_TOP_PAD, 128 * 1024),  # glibc's default
    ]:
        assert libc.mallopt(parameter, value) == 1, (parameter, value)
    libc.malloc_trim(0)
