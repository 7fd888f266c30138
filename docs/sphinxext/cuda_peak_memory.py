"""Each example's CUDA peak memory on GPU builds, for sphinx-gallery's ``show_memory``.

On a CPU build there is nothing: sphinx-gallery's own measurement would count the whole
process, which misleads on a page about one example.
"""

import torch


def cuda_peak_mib(example):
    """Run the example and return its CUDA peak in MiB, with its result.

    The peak counts only what the example allocated: memory that was still live when it
    started (kept by an earlier example) is subtracted. Without that, a page that failed at
    its imports showed 1.2 GB, all of it an earlier page's.
    """
    live_before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = example()
    return (torch.cuda.max_memory_allocated() - live_before) / 2**20, result


def memory_reporter():
    """The ``show_memory`` value: the CUDA reporter where a GPU builds the site, else False."""
    return cuda_peak_mib if torch.cuda.is_available() else False
