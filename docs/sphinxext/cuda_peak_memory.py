"""Each example's CUDA peak memory on GPU builds, for sphinx-gallery's ``show_memory``.

On a CPU build there is nothing: sphinx-gallery's own measurement would count the whole
process, which misleads on a page about one example.
"""

import torch


def cuda_peak_mib(example):
    """Run the example and return its CUDA peak in MiB, with its result."""
    torch.cuda.reset_peak_memory_stats()
    result = example()
    return torch.cuda.max_memory_allocated() / 2**20, result


def memory_reporter():
    """The ``show_memory`` value: the CUDA reporter where a GPU builds the site, else False."""
    return cuda_peak_mib if torch.cuda.is_available() else False
