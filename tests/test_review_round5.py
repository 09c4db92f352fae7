"""Review round 5: what landed this session (pipeline objects, token mixtures, media), used as a demanding user
would, each test a claim of the docs or the issues that failed before its fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import fastio


@pytest.fixture(scope="module")
def token_ds(tmp_path_factory) -> Path:
    """A token dataset of 60 documents of 1..40 tokens (end-of-document id 0), indexed in place."""
    from fastio.convert.token_index import TokenIndexConfig, index_tokens
    from fastio.formats.megatron import MegatronWriter

    dest = tmp_path_factory.mktemp("tokens") / "ds"
    dest.mkdir()
    rng = np.random.default_rng(0)
    writer = MegatronWriter(str(dest / "part-000.bin"), "uint16")
    for _ in range(60):
        writer.add(np.r_[rng.integers(1, 1000, int(rng.integers(0, 40))), 0])
    writer.close()
    index_tokens(TokenIndexConfig(dest, eos_id=0))
    return dest


@pytest.fixture(scope="module")
def image_ds(tmp_path_factory) -> Path:
    """6 solid-colour PNGs of 40 x 30 in two classes, converted."""
    from PIL import Image

    from fastio.convert.run import ConvertConfig, convert

    root = tmp_path_factory.mktemp("images")
    for k in range(6):
        (root / "src" / f"c{k % 2}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (40, 30), (40 * k, 90, 200)).save(root / "src" / f"c{k % 2}" / f"p{k}.png")
    convert(ConvertConfig(source=root / "src", dest=root / "ds", workers=1, progress=False))
    return root / "ds"


# -- FastioDataModule's validation Loader with a pipeline object (docs/trainers.md, docs/tokens.md) ------------

def _datamodule(train, val, **options):
    pytest.importorskip("lightning")
    from fastio.integrations.lightning import FastioDataModule

    return FastioDataModule(train, val, batch_size=4, device="cpu", num_threads=1, **options)


def test_datamodule_validates_a_token_dataset_with_the_training_tokens_pipeline(token_ds):
    """docs/tokens.md: FastioDataModule(DEST, pipeline=fastio.Tokens(...)); with a validation dataset its Loader
    read it as images ('image-eval') and was refused: a token dataset ..."""
    pipe = fastio.Tokens(seq_len=8)
    data = _datamodule(token_ds, token_ds, pipeline=pipe)
    assert data.val_config.pipeline == pipe
    assert (data.val_config.shuffle, data.val_config.remainder) == ("none", "partial")
    with fastio.Loader(token_ds, data.val_config, rank=0, world_size=1) as val:
        assert next(iter(val))["tokens"].shape == (4, 9)


def test_datamodule_validates_images_at_the_training_pipelines_size(image_ds):
    """ImageTrain(size=32, dtype='uint8') for training gave a validation Loader of ImageEval(size=224, float32):
    the object's options were lost, where the old spelling's image_size=32 carried over."""
    data = _datamodule(image_ds, image_ds, pipeline=fastio.ImageTrain(size=32, dtype="uint8"))
    assert data.val_config.pipeline == fastio.ImageEval(size=32, dtype="uint8")
    with fastio.Loader(image_ds, data.val_config, rank=0, world_size=1) as val:
        image = next(iter(val))["image"]
    assert image.shape == (4, 3, 32, 32) and str(image.dtype) == "torch.uint8"
    old = _datamodule(image_ds, image_ds, pipeline="image-train", image_size=32, eval_crop_ratio=0.5)
    assert old.val_config.pipeline == fastio.ImageEval(size=32, crop_ratio=0.5)  # the old spelling as before


# -- the old flat options over a config (docs/loader.md: Loader(dest, config, **changes); the old spellings) ------

def test_old_options_over_a_config_change_its_image_pipeline(image_ds):
    """Before the pipeline objects, ``Loader(dest, LoaderConfig(batch_size=4), image_size=16)`` changed the config's
    image size; it was refused as an option 'beside pipeline=ImageTrain(...)', an object the user never gave.
    The old options change the config's pipeline of an old kind, the rest of its options kept."""
    from fastio.loader import LoaderConfig

    config = LoaderConfig(batch_size=4, device="cpu", num_threads=1, world_size=1, rank=0, shuffle="none")
    with fastio.Loader(image_ds, config, image_size=16, dtype="uint8") as loader:
        assert loader.config.pipeline == fastio.ImageTrain(size=16, dtype="uint8")
        assert next(iter(loader))["image"].shape == (4, 3, 16, 16)
    evaluating = LoaderConfig(batch_size=4, pipeline=fastio.ImageEval(size=24, layout="HWC"), device="cpu")
    changed = fastio.Loader(image_ds, evaluating, eval_crop_ratio=0.5, num_threads=1, world_size=1, rank=0)
    with changed:
        assert changed.config.pipeline == fastio.ImageEval(size=24, layout="HWC", crop_ratio=0.5)
    raw = LoaderConfig(batch_size=4, pipeline="raw", device="cpu", world_size=1, rank=0)
    with fastio.Loader(image_ds, raw, fields=["cls"]) as loader:
        assert loader.config.pipeline == fastio.Raw(fields=("cls",)) and "png" not in next(iter(loader))
    with pytest.raises(ValueError, match=r"^image_size must be an integer >= 1, got 0"):  # still checked
        fastio.Loader(image_ds, config, image_size=0)
    tokens = LoaderConfig(pipeline=fastio.Tokens(seq_len=8), device="cpu")
    with pytest.raises(ValueError, match=r"^image_size=16 is an option of the pipeline object now"):
        fastio.Loader(image_ds, tokens, image_size=16)  # a kind without image options: refused as before


# -- a tar of video and image samples (docs/media.md: fastio index of media shards) ------------------------------

def test_a_video_loader_names_a_sample_without_a_video_as_lacking_its_video(tmp_path):
    """A tar holding one video sample and one image sample, indexed: VideoClips named the image sample as having
    'no image field (webm)'; what it lacks is its video."""
    pytest.importorskip("av")
    import io
    import tarfile

    from PIL import Image

    from fastio.convert.synthetic import make_video
    from fastio.convert.wds_index import IndexConfig, index_shards

    make_video(tmp_path / "v.webm", frames=6, fps=12)
    png = io.BytesIO()
    Image.new("RGB", (20, 20), (1, 2, 3)).save(png, "PNG")
    (tmp_path / "wds").mkdir()
    with tarfile.open(tmp_path / "wds" / "s-000000.tar", "w") as tar:
        for name, data in (("k0.webm", (tmp_path / "v.webm").read_bytes()), ("k0.cls", b"0"),
                           ("k1.png", png.getvalue()), ("k1.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    index_shards(IndexConfig(tmp_path / "wds"))
    clips = fastio.VideoClips(frames=2, size=8, dtype="uint8", crop="center")
    # refused when the Loader is made (since the media review), naming the sample and what it lacks
    with pytest.raises(fastio.DatasetError, match=r"1 of 2 samples have no video field \(the first: shard "
                                                  r"s-000000.tar key 'k1'; fields: cls, png, webm\)"):
        fastio.Loader(tmp_path / "wds", pipeline=clips, batch_size=2, device="cpu", shuffle="none",
                      num_threads=1, world_size=1, rank=0)


# -- loader.key on token datasets (docs/loader.md: loader.key(i); docs/tokens.md: batch["index"] a sequence id) ---

NO_KEYS = r"ds: a token dataset .*, not as samples: it has no sample keys$"


def test_key_of_a_token_loader_says_sequences_have_no_key_instead_of_calling_the_idx_damaged(token_ds):
    """``loader.key(i)`` of a Tokens Loader parsed Megatron's .idx as DALI's and said 'part-000.idx: not an index
    (non-ASCII byte ...)': a healthy dataset called damaged."""
    pipe = fastio.Tokens(seq_len=8)
    with fastio.Loader(token_ds, pipeline=pipe, batch_size=2, device="cpu", world_size=1, rank=0) as loader:
        with pytest.raises(fastio.DatasetError, match=NO_KEYS) as err:
            loader.key(0)
    assert "not an index" not in str(err.value) and "\n" not in str(err.value)
    mix = fastio.Mixture({"a": token_ds, "b": token_ds})
    with fastio.Loader(mix, pipeline=pipe, batch_size=2, device="cpu", world_size=1, rank=0) as loader:
        with pytest.raises(fastio.DatasetError, match=NO_KEYS):
            loader.key("b", 0)


def test_clip_pipelines_refuse_a_token_dataset_as_one(token_ds):
    """docs/tokens.md: a token dataset given to a pipeline of stored samples is refused in one line saying so; the
    clip kinds said 'dataset has no video field (its fields: )'."""
    for pipe in (fastio.VideoClips(frames=2, size=8), fastio.AudioClips()):
        with pytest.raises(fastio.DatasetError, match=rf"ds: a token dataset .*pipeline '{pipe.kind}' reads stored "
                                                      r"samples: read it with fastio.Tokens"):
            fastio.Loader(token_ds, pipeline=pipe, batch_size=2, device="cpu", world_size=1, rank=0)


def test_an_image_pipeline_on_a_video_dataset_points_to_the_clip_kinds(tmp_path):
    """An image pipeline on a video dataset said 'dataset has no image field; use pipeline='raw'', a way out that
    delivers bytes, not frames: it names the media field and the clip kind that reads it."""
    pytest.importorskip("av")
    from fastio.convert.run import ConvertConfig, convert
    from fastio.convert.synthetic import make_audio, make_video

    for i in range(2):
        make_video(tmp_path / "v" / "c0" / f"v{i}.webm", frames=4, fps=12)
        make_audio(tmp_path / "a" / "c0" / f"a{i}.flac", seconds=0.2, rate=16000, pitch=440.0)
    for kind, clips in (("v", r"webm: read it with fastio\.VideoClips"), ("a", r"flac: read it with fastio\.AudioClips")):
        convert(ConvertConfig(source=tmp_path / kind, dest=tmp_path / f"{kind}ds", workers=1, progress=False))
        with pytest.raises(fastio.DatasetError, match=rf"{kind}ds: dataset has no image field; it holds {clips}"):
            fastio.Loader(tmp_path / f"{kind}ds", pipeline=fastio.ImageTrain(size=8), batch_size=2, device="cpu")
