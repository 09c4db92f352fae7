"""What ``device="cuda"`` delivers: every tensor of a batch in GPU memory (images decoded there, the rest copied from
pinned host memory) but ``index``/``source``/``padded``, equal to the CPU Loader's batch; and the image kinds'
``hw_decoder_load`` (checked where it enters, used only by the GPU decoder)."""

from __future__ import annotations

import pytest
import torch
from tokens_helpers import image_text_dataset

import fastio
from fastio import ImageEval, ImageTrain, Loader

HOST = ("index", "source", "padded")


def _batches(dest, device: str, pipeline, n: int = 3, **kw) -> list[dict]:
    opts = dict(batch_size=4, pipeline=pipeline, device=device, seed=0, world_size=1, rank=0, num_threads=2)
    opts.update(kw)
    with Loader(dest, **opts) as loader:
        it = iter(loader)
        return [next(it) for _ in range(n)]


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.5", float("nan")])
def test_hw_decoder_load_outside_0_1_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"hw_decoder_load must be None or a number in \[0, 1\], got"):
        ImageTrain(hw_decoder_load=bad)


def test_hw_decoder_load_follows_into_the_evaluation_kind_and_leaves_cpu_decoding_alone(image_dataset):
    assert ImageTrain(size=32, hw_decoder_load=0.25).evaluation() == ImageEval(size=32, hw_decoder_load=0.25)
    plain = _batches(image_dataset, "cpu", ImageTrain(size=32))
    loaded = _batches(image_dataset, "cpu", ImageTrain(size=32, hw_decoder_load=1.0))
    assert all(torch.equal(a["image"], b["image"]) and torch.equal(a["index"], b["index"])
               for a, b in zip(plain, loaded))


def _same_on_the_gpu(cpu: list[dict], gpu: list[dict], close: tuple[str, ...] = ()) -> None:
    for c, g in zip(cpu, gpu):
        assert c.keys() == g.keys()
        for key, value in g.items():
            if not isinstance(value, torch.Tensor):
                assert value == c[key], key
                continue
            assert value.is_cuda == (key not in HOST), key
            assert value.dtype == c[key].dtype and value.shape == c[key].shape, key
            if key in close:  # different decoders (nvJPEG / the hardware decoder vs libjpeg-turbo): close
                assert float((value.cpu().float() - c[key].float()).abs().mean()) < 0.1, key
            else:
                assert torch.equal(value.cpu(), c[key]), key


@pytest.mark.gpu
@pytest.mark.parametrize("load", [None, 0.0, 1.0])
def test_cuda_image_batches_carry_the_cpu_graphs_samples_and_crops(image_dataset, load):
    pipe = ImageTrain(size=32, hw_decoder_load=load)
    _same_on_the_gpu(_batches(image_dataset, "cpu", pipe), _batches(image_dataset, "cuda", pipe), close=("image",))


@pytest.mark.gpu
def test_cuda_token_batches_are_the_cpu_ones_in_gpu_memory(token_ds):
    pipe = fastio.Tokens(seq_len=16)
    _same_on_the_gpu(_batches(token_ds, "cpu", pipe), _batches(token_ds, "cuda", pipe))


@pytest.mark.gpu
def test_cuda_image_text_batches_put_images_and_token_runs_in_gpu_memory(tmp_path):
    dest = image_text_dataset(tmp_path)
    pipe = fastio.ImageText(image=ImageEval(size=16), seq_len=256, image_seq_len=4)
    one = dict(n=1, batch_size=2)
    _same_on_the_gpu(_batches(dest, "cpu", pipe, **one), _batches(dest, "cuda", pipe, **one), close=("images",))


def test_a_cpu_output_of_a_cuda_graph_becomes_a_host_tensor_not_a_copy_into_gpu_memory():
    """On cuda a graph may output a node of CPU operators (a user's fastio.Graph): it becomes a host tensor, which the
    Loader then copies to the GPU through pinned memory, never DALI's GPU copy (feed_ndarray of a CPU tensor
    ``memcpy``s to the GPU tensor's address)."""
    import numpy as np
    from nvidia.dali.tensors import TensorCPU, TensorListCPU

    from fastio.loader import torch_value

    gpu = torch.device("cuda", 0)
    dense = np.arange(6, dtype=np.int32).reshape(2, 3)
    out = torch_value(TensorListCPU(dense), gpu, owned=False)
    assert out.device.type == "cpu" and torch.equal(out, torch.from_numpy(dense))
    owned = torch_value(TensorListCPU(dense), gpu, owned=True)
    assert owned.device.type == "cpu" and torch.equal(owned, torch.from_numpy(dense))
    ragged = torch_value(TensorListCPU([TensorCPU(np.arange(2)), TensorCPU(np.arange(3))]), gpu, owned=False)
    assert [t.tolist() for t in ragged] == [[0, 1], [0, 1, 2]] and all(t.device.type == "cpu" for t in ragged)


def _with_a_cpu_node(image, device):
    from nvidia.dali import fn, types

    sides = fn.cast(fn.random.uniform(range=[1, 9], shape=[2]), dtype=types.INT32)  # CPU operators only
    return {"image": fn.resize(image, size=[16, 16]), "sides": sides}


@pytest.mark.gpu
def test_a_cuda_graphs_cpu_output_arrives_in_gpu_memory(image_dataset):
    batches = _batches(image_dataset, "cuda", fastio.Graph(_with_a_cpu_node))
    for b in batches:
        assert b["image"].is_cuda and b["sides"].is_cuda and not b["index"].is_cuda
        assert b["sides"].dtype == torch.int32 and b["sides"].shape == (4, 2)
        assert int(b["sides"].min()) >= 1 and int(b["sides"].max()) <= 9
