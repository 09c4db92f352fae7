"""Reading batches: the ``Reader``, the read set (one dataset or a ``Mixture``), the ``Feeder`` and stats."""
