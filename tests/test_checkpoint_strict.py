"""Strict restores (issue 19.5): a checkpoint and an app that differ in keys or shapes are refused on both engines,
naming the keys; ``strict=False`` loads what matches and lists what it skipped. An optimizer of other parameter groups
and an elastic restore's per-rank state of another shape (real gloo ranks) are refused before anything loads."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import join_group, start_ranks
from torch import nn

from fastio.checkpoint import Checkpointer
from fastio.errors import CheckpointError

ENGINES = ["torchsnapshot", "dcp"]


def model(layers: int, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def saved(tmp_path, engine: str, app: dict) -> Checkpointer:
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        ckpt.save(1, app, blocking=True)
    return Checkpointer(tmp_path / "ck", signals=())


@pytest.mark.parametrize("engine", ENGINES)
def test_fewer_layers_is_refused_naming_the_keys(tmp_path, engine):
    ckpt = saved(tmp_path, engine, {"model": model(3)})
    small = model(2)
    with pytest.raises(CheckpointError, match=r"app key model: in the checkpoint, not in the app: 2\.bias, 2\.weight"):
        ckpt.restore_latest({"model": small})
    ckpt.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_more_layers_and_other_shapes_are_refused(tmp_path, engine):
    ckpt = saved(tmp_path, engine, {"model": model(2)})
    with pytest.raises(CheckpointError, match=r"in the app, not in the checkpoint: 2\.bias, 2\.weight"):
        ckpt.restore_latest({"model": model(3)})
    with pytest.raises(CheckpointError, match=r"other shape: 0\.bias \(checkpoint 8, app 4\)"):
        ckpt.restore_latest({"model": nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 8))})
    ckpt.close()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("saved_dtype, app_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_another_dtype_is_refused_unless_a_cast_is_asked_for(tmp_path, engine, saved_dtype, app_dtype):
    """Before: a checkpoint of an fp32 model restored into a bf16 one (or the reverse) was cast without a word, on
    both engines: a dtype changed by mistake gave other weights silently. Now strict refuses it before anything
    loads, naming the app key, the state keys and both dtypes, and the way to ask for the cast; strict=False leaves
    those tensors as they are and lists them; restore_latest(..., cast_dtypes=True) casts them as torch does."""
    old = model(2).to(saved_dtype)
    ckpt = saved(tmp_path, engine, {"model": old})
    new = model(2).to(app_dtype)
    with torch.no_grad():
        for p in new.parameters():
            p.zero_()
    a, b = str(saved_dtype), str(app_dtype)
    with pytest.raises(CheckpointError) as err:
        ckpt.restore_latest({"model": new})
    said = str(err.value)
    assert (f"app key model: other dtype: 0.bias (checkpoint {a}, app {b}), 0.weight (checkpoint {a}, app {b}), "
            f"1.bias (checkpoint {a}, app {b}), 1.weight (checkpoint {a}, app {b})") in said, said
    assert "cast_dtypes=True" in said and "\n" not in said, said
    assert all(not p.any() for p in new.parameters())  # nothing loaded
    skipped = ckpt.restore_latest({"model": new}, strict=False).skipped
    assert any(s.startswith("app key model: other dtype: 0.bias") for s in skipped), skipped
    assert all(not p.any() for p in new.parameters())  # left as they were
    assert ckpt.restore_latest({"model": new}, cast_dtypes=True).skipped == []
    for key, value in old.state_dict().items():
        assert new.state_dict()[key].dtype == app_dtype and torch.equal(new.state_dict()[key], value.to(app_dtype))
    ckpt.close()


def test_cast_dtypes_must_be_a_bool(tmp_path):
    """A string ('no') would have asked for the cast; it is refused, naming the argument, before anything loads."""
    ckpt = saved(tmp_path, "torchsnapshot", {"model": model(2)})
    new = model(2).double()
    with pytest.raises(TypeError, match=r"^cast_dtypes must be True or False, got 'no'$"):
        ckpt.restore_latest({"model": new}, cast_dtypes="no")
    ckpt.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_another_dtype_is_refused_before_the_apps_own_objects_load(tmp_path, engine):
    """The app's own objects (a counter) load before the engine's keys: a dtype refused only by the engine's load
    would leave the counter loaded and the model not. The check before anything loads names it instead."""
    from helpers import StateHolder

    ckpt = saved(tmp_path, engine, {"model": model(2), "counter": StateHolder({"n": 5})})
    counter = StateHolder({"n": 0})
    with pytest.raises(CheckpointError, match=r"app key model: other dtype: 0\.bias \(checkpoint torch\.float32, app "
                                              r"torch\.float64\)"):
        ckpt.restore_latest({"model": model(2).double(), "counter": counter})
    assert counter.state == {"n": 0}
    assert ckpt.restore_latest({"model": model(2).double(), "counter": counter}, cast_dtypes=True).step == 1
    assert counter.state == {"n": 5}
    ckpt.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_app_key_missing_from_the_app_is_refused(tmp_path, engine):
    ckpt = saved(tmp_path, engine, {"model": model(1), "extra": model(1)})
    with pytest.raises(CheckpointError, match=r"app key extra, which this app lacks"):
        ckpt.restore_latest({"model": model(1)})
    ckpt.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_not_strict_loads_what_matches_and_lists_the_rest(tmp_path, engine, caplog):
    big = model(3)
    with torch.no_grad():
        for p in big.parameters():
            p.add_(1.0)
    ckpt = saved(tmp_path, engine, {"model": big, "extra": model(1)})
    small = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))  # layer 1: another shape; layer 2: not here
    untouched = small[1].weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="fastio.checkpoint.checkpointer"):
        state = ckpt.restore_latest({"model": small}, strict=False)
    ckpt.close()
    assert torch.equal(small[0].weight, big[0].weight) and torch.equal(small[0].bias, big[0].bias)
    assert torch.equal(small[1].weight, untouched)
    text = "; ".join(state.skipped)
    assert "app key extra (not in this app)" in text
    assert "not in the app: 2.bias, 2.weight" in text
    assert "other shape: 1.bias (checkpoint 8, app 4), 1.weight (checkpoint 8x8, app 4x8)" in text
    assert "strict=False" in caplog.text and "2.weight" in caplog.text


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))


def two_groups(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.01}])


def trained(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).square().mean().backward()
    optim.step()


def snapshot(app: dict) -> dict[str, torch.Tensor]:
    """Every tensor of every module and optimizer in ``app``, copied (a bitwise 'before')."""
    out = {}
    for key, obj in app.items():
        if isinstance(obj, nn.Module):
            out.update({f"{key}.{k}": v.clone() for k, v in obj.state_dict().items()})
        else:
            for i, st in obj.state_dict()["state"].items():
                out.update({f"{key}.{i}.{k}": v.clone() for k, v in st.items() if torch.is_tensor(v)})
    return out


def unchanged(app: dict, before: dict[str, torch.Tensor]) -> bool:
    now = snapshot(app)
    return now.keys() == before.keys() and all(torch.equal(now[k], before[k]) for k in now)


def saved_two_groups(tmp_path: Path, engine: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = net()
    optim = two_groups(model)
    trained(model, optim)
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
    return model, optim


def other_app() -> dict:
    torch.manual_seed(1)  # weights unlike the saved ones
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    optim = torch.optim.Adam(model.parameters())  # one group of 4 parameters, the checkpoint's two of 2
    trained(model, optim)
    return {"model": model, "optim": optim}


GROUPS = ("app key optim: the checkpoint's optimizer has 2 parameter groups (2, 2 parameters), the app's 1 parameter "
          "group (4 parameters)")


@pytest.mark.parametrize("engine", ENGINES)
def test_other_parameter_groups_refused_before_the_model_loads(tmp_path, engine):
    saved_two_groups(tmp_path, engine)
    app = other_app()
    before = snapshot(app)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        with pytest.raises(CheckpointError) as err:
            ckpt.restore_latest(app)
    text = str(err.value)
    assert "\n" not in text and text.startswith(str(tmp_path / "ck" / "step-1")), text
    if engine == "torchsnapshot":
        assert GROUPS in text, text
    else:  # DCP keys optimizer state by parameter name: its planner names the saved group the app lacks
        assert "app key optim: in the checkpoint, not in the app: param_groups.1." in text, text
    assert unchanged(app, before)  # the model (and the optimizer) bitwise as they were


def test_dcp_optimizer_of_no_app_module_refused_naming_its_groups(tmp_path):
    """DCP writes an optimizer over parameters of no app module per rank (positional state): the same check."""
    model, other = net(), net()
    optim = two_groups(other)
    trained(other, optim)
    with Checkpointer(tmp_path / "ck", signals=(), engine="dcp") as ckpt:
        ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
    app = other_app()
    app["optim"] = torch.optim.Adam(net().parameters())
    before = snapshot(app)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        with pytest.raises(CheckpointError, match=re.escape(GROUPS)):
            ckpt.restore_latest(app)
    assert unchanged(app, before)


@pytest.mark.parametrize("engine", ENGINES)
def test_not_strict_loads_the_model_and_skips_what_cannot_load(tmp_path, engine, caplog):
    """torchsnapshot: the optimizer's state is positional, so one of other groups is left as it was (listed);
    DCP: its state is keyed by parameter name: each parameter's loads, the app's groups stay (listed)."""
    model, optim = saved_two_groups(tmp_path, engine)
    app = other_app()
    optim_before = {k: v for k, v in snapshot(app).items() if k.startswith("optim.")}
    with caplog.at_level(logging.WARNING, logger="fastio"):
        with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
            state = ckpt.restore_latest(app, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(app["model"].state_dict().values(), model.state_dict().values()))
    assert [len(g["params"]) for g in app["optim"].param_groups] == [4]
    optim_now = {k: v for k, v in snapshot(app).items() if k.startswith("optim.")}
    assert optim_now.keys() == optim_before.keys()
    if engine == "torchsnapshot":
        assert all(torch.equal(optim_now[k], optim_before[k]) for k in optim_now)  # left as it was
        assert state.skipped == [f"{GROUPS} (optimizer left as it was)"], state.skipped
    else:
        saved, now = optim.state_dict()["state"], app["optim"].state_dict()["state"]
        assert all(torch.equal(now[i][k], saved[i][k]) for i in range(4) for k in ("exp_avg", "exp_avg_sq"))
        assert state.skipped == ["app key optim: the checkpoint's optimizer has 2 parameter groups, the app's 1 "
                                 "parameter group (the app's groups kept, each parameter's state loaded by name)"]
        assert app["optim"].param_groups[0]["lr"] == 0.001  # the app's group
    assert "skipped: app key optim" in caplog.text


@pytest.mark.parametrize("engine", ENGINES)
def test_same_parameter_groups_still_restore(tmp_path, engine):
    model, optim = saved_two_groups(tmp_path, engine)
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    mine = two_groups(fresh)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.restore_latest({"model": fresh, "optim": mine})
    assert [g["lr"] for g in mine.param_groups] == [0.001, 0.01]
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert all(torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in zip(mine.state.values(), optim.state.values()))


def ranked_app(rank: int, engine: str) -> dict:
    """2 saving ranks: a DDP model (replicated, global with DCP) and per-rank state of the rank's own shape:
    torchsnapshot a head module (rank 1's 4x3, rank 0's 4x2), DCP an optimizer of no app module (rank 1's of
    two parameter groups, rank 0's of one). Restoring at 3 ranks, rank 1 gets saved rank 1's, which does not fit
    the app built as rank 0's."""
    torch.manual_seed(0)
    app = {"model": nn.parallel.DistributedDataParallel(nn.Linear(16, 4))}
    if engine == "torchsnapshot":
        app["head"] = nn.Linear(4, 2 + rank)
    else:
        other = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        app["optim"] = two_groups(other) if rank == 1 else torch.optim.Adam(other.parameters())
    return app


def elastic_worker(rank: int, base: str) -> None:
    def group(world: int) -> None:
        join_group(rank, world, Path(base, f"w{world}.port"))

    if rank < 2:
        group(2)
        try:
            for engine in ENGINES:
                app = ranked_app(rank, engine)
                with torch.no_grad():  # saved weights: the fresh ones + 1
                    for obj in app.values():
                        for p in obj.parameters() if isinstance(obj, nn.Module) else ():
                            p.add_(1.0)
                with Checkpointer(Path(base, engine), signals=(), engine=engine) as ckpt:
                    ckpt.save(1, app, blocking=True)
        finally:
            dist.destroy_process_group()
    group(3)
    try:
        out: dict = {}
        for engine in ENGINES:
            for strict in (True, False):
                app = ranked_app(0, engine)  # every rank builds rank 0's app
                before = snapshot(app)
                try:
                    with Checkpointer(Path(base, engine), signals=()) as ckpt:
                        skipped = ckpt.restore_latest(app, strict=strict).skipped
                    error = None
                except CheckpointError as err:
                    error, skipped = str(err), []
                head = app.get("head")
                out[f"{engine}-{strict}"] = {
                    "error": error, "skipped": skipped, "unchanged": unchanged(app, before),
                    "model": app["model"].module.weight.sum().item(),
                    "head": head.weight.sum().item() if head is not None else None}
        Path(base, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def elastic_runs(tmp_path_factory) -> list[dict]:
    base = tmp_path_factory.mktemp("elastic6")
    start_ranks(elastic_worker, (str(base),), 3)
    return [json.loads(Path(base, f"rank{r}.json").read_text()) for r in range(3)]


@pytest.mark.parametrize("engine", ENGINES)
def test_elastic_per_rank_state_of_another_shape_refused_before_anything_loads(elastic_runs, engine):
    key = "head" if engine == "torchsnapshot" else "optim"
    for rank, res in enumerate(elastic_runs):
        got = res[f"{engine}-True"]
        assert got["error"] and "\n" not in got["error"], (rank, got)
        assert "rank 1 takes saved rank 1's state" in got["error"], (rank, got["error"])
        assert f"app key {key}" in got["error"], (rank, got["error"])
        assert got["unchanged"], rank  # the replicated model too: nothing loaded on any rank


def test_elastic_not_strict_loads_what_fits_per_rank(elastic_runs):
    """torchsnapshot: the head that does not fit (rank 1's) is left as it was and listed; the other ranks' heads
    and every rank's model load. DCP: rank 1's optimizer is left as it was and listed."""
    for rank, res in enumerate(elastic_runs):
        got, fresh = res["torchsnapshot-False"], res["torchsnapshot-True"]  # the refused restore left it fresh
        assert got["error"] is None, (rank, got)
        assert got["model"] == pytest.approx(fresh["model"] + 64), rank  # the saved weight (+1 each)
        assert got["head"] == pytest.approx(fresh["head"] + (0 if rank == 1 else 8)), rank
        assert any("app key head: other shape" in s for s in got["skipped"]) == (rank == 1), (rank, got)
        dcp = res["dcp-False"]
        assert dcp["error"] is None and dcp["model"] == pytest.approx(res["dcp-True"]["model"] + 64), (rank, dcp)
        assert any("app key optim: the checkpoint's optimizer has 2" in s for s in dcp["skipped"]) == (rank == 1), \
            (rank, dcp)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_model_on_the_meta_device_is_refused_naming_its_key(tmp_path, engine, strict):
    """A model made on the meta device and not yet materialised (``to_empty``) has no storage to restore into.
    Before: torchsnapshot returned the step as restored with every tensor still meta (a later ``to_empty`` and
    init trained from random weights at the saved step); DCP failed with 'ValueError: Default process group has not
    been initialized'. Now one line naming the app key and its tensors, nothing loaded, also with strict=False."""
    ckpt = saved(tmp_path, engine, {"model": model(2), "other": model(1)})
    with torch.device("meta"):
        empty = model(2)
    other = model(1)
    other_before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        ckpt.restore_latest({"model": empty, "other": other}, strict=strict)
    ckpt.close()
    text = str(err.value)
    assert ("app key model: its tensors are on the meta device, with no storage to restore into: 0.weight, 0.bias, "
            "1.weight, 1.bias (materialise the model first: model.to_empty(device=...))") in text, text
    assert "\n" not in text
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in other_before.items())


def test_a_non_persistent_buffer_left_on_the_meta_device_does_not_refuse_the_restore(tmp_path):
    """Only the state a restore fills is judged: a buffer outside the state dict (``persistent=False``) is not."""
    ckpt = saved(tmp_path, "torchsnapshot", {"model": model(1)})
    into = model(1)
    into.register_buffer("cache", torch.empty(4, device="meta"), persistent=False)
    assert ckpt.restore_latest({"model": into}).step == 1
    ckpt.close()


def dtype_saver(rank: int, base: str) -> None:
    """2 ranks save a head of their own weights (per rank with torchsnapshot, global with DCP), fp32."""
    join_group(rank, 2, Path(base, "w2.port"))
    try:
        for engine in ENGINES:
            torch.manual_seed(rank)
            with Checkpointer(Path(base, engine), signals=(), engine=engine) as ckpt:
                ckpt.save(1, {"head": nn.Linear(4, 2)}, blocking=True)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("engine", ENGINES)
def test_elastic_per_rank_module_of_another_dtype_refused_unless_cast(tmp_path, engine):
    """At another world size (2 saving ranks, this one process) a module of another dtype is refused too (with
    torchsnapshot the per-rank state this rank takes); cast_dtypes=True loads saved rank 0's, cast."""
    start_ranks(dtype_saver, (str(tmp_path),), 2)
    torch.manual_seed(0)
    expected = nn.Linear(4, 2)
    head = nn.Linear(4, 2).double()
    with torch.no_grad():
        head.weight.zero_()
    with Checkpointer(tmp_path / engine, signals=()) as ckpt:
        with pytest.raises(CheckpointError, match=r"app key head: other dtype: bias \(checkpoint torch\.float32, app "
                                                  r"torch\.float64\), weight"):
            ckpt.restore_latest({"head": head})
        assert not head.weight.any()
        ckpt.restore_latest({"head": head}, cast_dtypes=True)
    assert head.weight.dtype == torch.float64 and torch.equal(head.weight, expected.weight.double())
