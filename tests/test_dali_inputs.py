"""What the Loader feeds its DALI graph: DALI's own tensors sharing the read bytes, kept by the feeder until the
batch's outputs come back, so that none of DALI's threads has to take the interpreter lock to let go of them
(issue 45)."""

from __future__ import annotations

import numpy as np

from fastio import ImageTrain, Loader
from fastio.dataset.dataset import Dataset
from fastio.pipelines.base import dali_inputs
from fastio.read.reader import Reader


def test_the_graph_is_fed_dalis_tensors_sharing_the_read_bytes(image_dataset):
    from nvidia.dali.tensors import TensorCPU, TensorListCPU

    graph = ImageTrain(size=16).graph()
    with Reader(Dataset(image_dataset), [], threads=1, image=("jpg",), sizes=True) as reader:
        read = reader.read_batch(np.arange(8))
    plain, fed = graph.feed(read, seed=0, epoch=0), dali_inputs(graph.feed)(read, seed=0, epoch=0)
    encoded, *whole = fed
    assert all(isinstance(t, TensorCPU) for t in encoded) and all(isinstance(t, TensorListCPU) for t in whole)
    for t, a in zip(encoded, read.image):  # the read bytes themselves, not a copy
        assert np.asarray(t).__array_interface__["data"][0] == a.__array_interface__["data"][0]
    assert all(np.array_equal(t.as_array(), a) for t, a in zip(whole, plain[1:]))


def test_until_a_batch_comes_out_the_feeder_holds_dalis_tensors_of_it(image_dataset):
    """DALI wraps a numpy array fed with ``no_copy`` in an object of its own that lets go of it under the interpreter
    lock, in whichever of DALI's threads drops it last: while the training loop or a reader thread ran Python, that
    thread waited for the lock (measured: several waits a batch, each up to the switch interval). Fed its own tensors,
    which the feeder holds until the batch's outputs come back, the feeder drops the last reference, in the Loader's
    thread."""
    from nvidia.dali.tensors import TensorCPU, TensorListCPU

    loader = Loader(image_dataset, batch_size=8, pipeline=ImageTrain(size=16), device="cpu", world_size=1, rank=0,
                    num_threads=1)
    it = iter(loader)
    for _ in range(3):
        next(it)
        in_graph = list(loader._feeder._fed)
        assert in_graph and all(isinstance(t, TensorCPU) for g in in_graph for t in g.inputs[0])
        assert all(isinstance(t, TensorListCPU) for g in in_graph for t in g.inputs[1:])
    loader.close()
