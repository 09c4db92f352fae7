"""Sample order: the pure ``(seed, epoch)`` order of one dataset (``Sampler``) and of a mixture."""
