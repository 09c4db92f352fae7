"""Strict restores: what a checkpoint holds against what the app has room for, one rule for both engines.

A restore compares, per app key, the state keys the checkpoint holds with the state keys the app object has
(and, of tensors present in both, their shapes, their dtypes, and whether the checkpoint's is quantized where the
app's is not). By default any difference is a
:class:`~fastio.errors.CheckpointError` naming the app key and the state keys. With ``strict=False`` what
matches is loaded, the rest of the app's state is left as it is, and every skipped key is listed (the
Checkpointer logs them and hands them back in ``TrainState.skipped``). A tensor of another dtype (saved fp32, the
app's bf16) is a difference unless the restore is asked to cast (``cast``: ``restore_latest(..., cast_dtypes=True)``,
which copies it with torch's cast), since a dtype changed by mistake would give other weights without a word.

The engines apply the rule where they see both sides: torchsnapshot through :class:`CheckedModule` (the state
dict it rebuilt against the module's own; with ``strict``, its manifest against every module first), DCP in its
load planner (the checkpoint's metadata against the flattened state dict it is asked to fill). An optimizer's
parameter groups are part of the rule (their number and sizes, and for torch's own optimizers the settings the app's kind
needs): torchsnapshot's state is positional, so an optimizer of other groups is
skipped whole; DCP's is keyed by parameter name, so with another number of groups the app's groups stay and each
parameter's state loads by name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from fastio.errors import CheckpointError
from fastio.words import agree, count

__all__ = ["PARAM_SHAPED", "CheckedModule", "Mismatch", "class_mismatch", "group_sizes", "groups_mismatch",
           "module_shapes", "optimizer_classes", "other_dtypes", "quantized_dtype", "quantized_keys", "settings_mismatch",
           "shape_of", "state_mismatch"]

_SHOWN = 8


def shape_of(value: Any) -> tuple[int, ...] | None:
    """The (global) shape of a tensor-like value, None for anything else."""
    shape = getattr(value, "shape", None)
    return tuple(int(n) for n in shape) if shape is not None and hasattr(value, "dtype") else None


def quantized_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` (a torch dtype or its name, ``torch.qint8``) is a quantized tensor's."""
    return str(dtype).startswith(("torch.qint", "torch.quint"))


def quantized_keys(saved: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """The state keys whose tensor the checkpoint holds quantized (``saved``: state key -> its dtype, a torch dtype or
    its name) where the app holds a tensor that is not (``own``: state key -> the app's value), which torch cannot
    copy it into: state key -> (the checkpoint's dtype, the app's)."""
    return {k: (str(d), str(own[k].dtype)) for k, d in saved.items()
            if quantized_dtype(d) and getattr(own.get(k), "is_quantized", True) is False}


def other_dtypes(saved: Mapping[str, Any], own: Mapping[str, Any], *, cast: bool = False) -> dict[str, tuple[str, str]]:
    """The state keys whose tensor the checkpoint holds in another dtype than the app's tensor (``saved``: state key ->
    its dtype, a torch dtype or its name; ``own``: state key -> the app's value), quantized ones aside
    (:func:`quantized_keys`): state key -> (the checkpoint's dtype, the app's). Empty with ``cast`` (the restore
    was asked to cast them)."""
    out: dict[str, tuple[str, str]] = {}
    for k, d in ({} if cast else saved).items():
        mine = getattr(own.get(k), "dtype", None)
        if mine is None or shape_of(own[k]) is None or quantized_dtype(d) or quantized_dtype(mine):
            continue
        if str(d) != str(mine):
            out[k] = (str(d), str(mine))
    return out


def group_sizes(groups: Any) -> list[int] | None:
    """How many parameters each of an optimizer's ``param_groups`` holds (a list of dicts with a ``params``
    list: an optimizer's attribute or its state dict's entry); None for anything else."""
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        return None
    return [len(g["params"]) for g in groups]


def _groups(sizes: list[int]) -> str:
    parameters = agree(sizes[0] if len(sizes) == 1 else 0, "parameter")
    return f"{count(len(sizes), 'parameter group')} ({', '.join(map(str, sizes)) or 'none'} {parameters})"


_GROUP = re.compile(r"param_groups\.(\d+)\.")
"""A parameter group's state key as DCP flattens an optimizer's state (``param_groups.1.lr``)."""


def _group_count(keys: Iterable[str]) -> int:
    return len({m.group(1) for k in keys if (m := _GROUP.match(k))})



def groups_mismatch(key: str, saved: list[int] | None, own: list[int] | None) -> str | None:
    """One line when an optimizer's saved parameter groups (``saved``: parameters per group) cannot load into
    the app's (``own``): another count of groups, or another count of parameters in a group (what torch's own
    ``Optimizer.load_state_dict`` refuses, found here before anything loads); None when they fit or either
    side is not an optimizer's."""
    if saved is None or own is None or saved == own:
        return None
    return f"app key {key}: the checkpoint's optimizer has {_groups(saved)}, the app's {_groups(own)}"


PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg",
                          "acc_delta", "sum", "exp_inf", "ax", "prev", "step_size"})
"""The per-parameter state torch's own optimizers (``torch.optim``) keep in their parameter's shape."""


def _torch_optimizer(optim: Any) -> Any:
    """``optim`` when it is one of torch's own optimizers (``torch.optim``), or the one a wrapper holds (Accelerate's
    ``.optimizer``, Lightning's ``._optimizer``); None otherwise."""
    for _ in range(3):
        if type(optim).__module__.startswith("torch.optim."):
            return optim
        optim = getattr(optim, "optimizer", None) or getattr(optim, "_optimizer", None)
    return optim if type(optim).__module__.startswith("torch.optim.") else None


def _inner_optimizer(optim: Any) -> Any:
    """The optimizer an optimizer wrapper holds (Accelerate's ``.optimizer``, Lightning's ``._optimizer``), or ``optim``
    itself: the innermost object with an optimizer's ``param_groups``."""
    for _ in range(3):
        inner = getattr(optim, "optimizer", None) or getattr(optim, "_optimizer", None)
        if inner is None or group_sizes(getattr(inner, "param_groups", None)) is None:
            break
        optim = inner
    return optim


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def optimizer_classes(app: Mapping[str, Any]) -> dict[str, str]:
    """App key -> the class (``torch.optim.adamw.AdamW``) of each app object that is an optimizer (has an optimizer's
    ``param_groups``; a wrapper's inner optimizer), as the commit marker records it: Adam and AdamW keep the same
    state and settings, so nothing else in a checkpoint tells them apart."""
    return {key: _class_name(_inner_optimizer(obj)) for key, obj in app.items()
            if group_sizes(getattr(obj, "param_groups", None)) is not None}


def class_mismatch(key: str, saved: Any, optim: Any) -> str | None:
    """One line when the checkpoint's optimizer of ``key`` was of another class (``saved``: the marker's record, a
    dotted name) than the app's ``optim``; None when they match (:func:`_same_class`), or either is not known (a
    marker of an older fastio, an object that is not an optimizer)."""
    if not isinstance(saved, str) or group_sizes(getattr(optim, "param_groups", None)) is None:
        return None
    own = _class_name(_inner_optimizer(optim))
    if _same_class(saved, own):
        return None
    return f"app key {key}: the checkpoint's optimizer is a {saved}, the app's a {own}"


_TORCH_OPTIM = "torch.optim."


def _same_class(saved: str, own: str) -> bool:
    """Whether a recorded optimizer class (``saved``) is the app's (``own``, module and qualified name): the same
    dotted name; within ``torch.optim`` the same class name (torch moves its optimizers between its modules); a
    record of the class name only (no module) the same name. Another library's ``AdamW`` is not torch's."""
    if saved == own:
        return True
    name = own.rsplit(".", 1)[-1]
    if "." not in saved:
        return saved == name
    return saved.startswith(_TORCH_OPTIM) and own.startswith(_TORCH_OPTIM) and saved.rsplit(".", 1)[-1] == name


def _settings_lacking(optim: Any, names: set[str]) -> list[str]:
    """The settings of ``optim``'s kind (its ``defaults``) that a parameter group holding only ``names`` still lacks
    once torch loads it: what the class's ``__setstate__`` fills in for a state of an older torch is not lacking. A
    scratch optimizer of the class is given the group (no tensor, no parameter); nothing when that fails."""
    group: dict[str, Any] = dict.fromkeys(names)
    group["params"] = []
    try:
        scratch = type(optim).__new__(type(optim))
        scratch.__setstate__({"defaults": dict(optim.defaults), "state": {}, "param_groups": [group]})
    except Exception:  # noqa: BLE001 - an optimizer whose __setstate__ needs more: torch's own load decides
        return []
    return sorted(set(optim.defaults) - set(group))


def settings_mismatch(key: str, saved: list[set[str]] | None, optim: Any) -> str | None:
    """One line when a torch optimizer's parameter groups in a checkpoint (``saved``: the setting names of each
    group, ``lr``, ``betas``, ...) lack a setting the app's optimizer needs: a checkpoint of another kind of optimizer
    (SGD's into Adam), which torch's ``load_state_dict`` takes, its groups replacing the app's, and whose state or
    next step then fails (``KeyError: 'momentum'``). None when they fit, or for another optimizer."""
    optim = _torch_optimizer(optim)
    for g, names in enumerate(saved or [] if optim is not None else []):
        lacking = _settings_lacking(optim, names)
        if lacking:
            return (f"app key {key}: the checkpoint's optimizer has no {', '.join(lacking)} in parameter group {g}, "
                    f"which the app's {type(optim).__name__} needs (saved by another kind of optimizer?)")
    return None


def state_mismatch(key: str, saved: Mapping[tuple[int, str], tuple[int, ...]], optim: Any) -> str | None:
    """One line when a torch optimizer's positional state in a checkpoint (``saved``: (parameter position, state
    name) -> shape) holds a tensor kept in the parameter's shape (:data:`PARAM_SHAPED`) of another shape than
    the app's parameter at that position (groups of as many parameters, in another order): torch's
    ``load_state_dict`` takes it, and its next step fails. None when they fit, or for another optimizer. A
    wrapper's optimizer (Accelerate's ``.optimizer``, Lightning's ``._optimizer``) is looked into."""
    optim = _torch_optimizer(optim)
    if optim is None:
        return None
    params = [(g, p) for g, group in enumerate(optim.param_groups) for p in group["params"]]
    for (i, name), shape in sorted(saved.items()):
        if name in PARAM_SHAPED and i < len(params) and tuple(params[i][1].shape) != tuple(shape):
            return (f"app key {key}: the checkpoint's optimizer state of parameter {i} (group {params[i][0]}) has "
                    f"{name} of {_dims(tuple(shape))}, the app's parameter {_dims(tuple(params[i][1].shape))}")
    return None


def module_shapes(module: Any) -> dict[str, tuple[int, ...] | None]:
    """A module's state keys with the shape of each tensor (None for anything else)."""
    return {k: shape_of(v) for k, v in module.state_dict().items()}


def _names(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def _dims(shape: tuple[int, ...] | None) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


class Mismatch:
    """The differences between one app key's state in a checkpoint and in the app."""

    def __init__(self, key: str, saved: Mapping[str, tuple[int, ...] | None], own: Mapping[str, tuple[int, ...] | None],
                 quantized: Mapping[str, tuple[str, str]] | None = None,
                 dtypes: Mapping[str, tuple[str, str]] | None = None):
        self.key, self._saved, self._own = key, set(saved), set(own)
        self.quantized = sorted((k, a, b) for k, (a, b) in (quantized or {}).items())
        """Tensors quantized in the checkpoint, not in the app (:func:`quantized_keys`): (state key, checkpoint's
        dtype, app's dtype)."""
        self.dtypes = sorted((k, a, b) for k, (a, b) in (dtypes or {}).items()
                             if k in own and saved.get(k) == own[k])
        """Tensors in both, of the same shape and another dtype (:func:`other_dtypes`): (state key, checkpoint's
        dtype, app's dtype)."""
        self.kept: set[str] = set()
        """The app's parameter groups' keys, left as they are (:meth:`keep_groups`)."""
        self.unexpected = sorted(k for k in saved if k not in own)
        """In the checkpoint, not in the app."""
        self.missing = sorted(k for k in own if k not in saved)
        """In the app, not in the checkpoint."""
        self.shapes = sorted((k, saved[k], own[k]) for k in saved if k in own and saved[k] != own[k]
                             and saved[k] is not None and own[k] is not None)
        """Tensors in both, of other shapes: (state key, checkpoint's shape, app's shape)."""

    def __bool__(self) -> bool:
        return bool(self.unexpected or self.missing or self.shapes or self.quantized or self.dtypes)

    @property
    def skipped_keys(self) -> set[str]:
        """The app's state keys a non-strict restore leaves as they are."""
        return set(self.missing) | {k for k, _, _ in self.shapes + self.quantized + self.dtypes} | self.kept

    def groups_line(self) -> str | None:
        """One line when this is an optimizer's state as DCP names it (``param_groups.G.lr``) and the checkpoint
        holds another number of parameter groups than the app; None otherwise."""
        saved, own = _group_count(self._saved), _group_count(self._own)
        if not saved or not own or saved == own:
            return None
        return (f"app key {self.key}: the checkpoint's optimizer has {count(saved, 'parameter group')}, the app's "
                f"{count(own, 'parameter group')}")

    def keep_groups(self) -> None:
        """Leave the app's parameter groups as they are (the checkpoint's would name other parameters): their
        keys are skipped and no longer listed as differences."""
        self.kept = {k for k in self._own if _GROUP.match(k)}
        self.unexpected = [k for k in self.unexpected if not _GROUP.match(k)]
        self.missing = [k for k in self.missing if not _GROUP.match(k)]
        self.shapes = [s for s in self.shapes if not _GROUP.match(s[0])]
        self.dtypes = [s for s in self.dtypes if not _GROUP.match(s[0])]

    def lines(self) -> list[str]:
        """One line per kind of difference, naming the app key and the state keys."""
        out = []
        if self.unexpected:
            out.append(f"app key {self.key}: in the checkpoint, not in the app: {_names(self.unexpected)}")
        if self.missing:
            out.append(f"app key {self.key}: in the app, not in the checkpoint: {_names(self.missing)}")
        if self.shapes:
            shown = [f"{k} (checkpoint {_dims(a)}, app {_dims(b)})" for k, a, b in self.shapes]
            out.append(f"app key {self.key}: other shape: {_names(shown)}")
        if self.quantized:
            shown = [f"{k} ({a}, app {b})" for k, a, b in self.quantized]
            out.append(f"app key {self.key}: quantized in the checkpoint, not in the app: {_names(shown)}")
        if self.dtypes:
            shown = [f"{k} (checkpoint {a}, app {b})" for k, a, b in self.dtypes]
            out.append(f"app key {self.key}: other dtype: {_names(shown)} (restore_latest(..., cast_dtypes=True) "
                       "casts them)")
        return out

    def refusal(self, where: str) -> CheckpointError:
        return CheckpointError(f"{where}: checkpoint does not match the app: {'; '.join(self.lines())} "
                               "(restore_latest(..., strict=False) loads what matches and lists the rest)")


class CheckedModule:
    """An ``nn.Module`` as a restore target that applies the rule to the state dict it is given."""

    def __init__(self, key: str, module: Any, *, strict: bool, where: str, skipped: list[str], cast: bool = False):
        self.key, self.module, self.strict, self.where, self.skipped = key, module, strict, where, skipped
        self.cast = cast

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        own = self.module.state_dict()
        found = Mismatch(self.key, {k: shape_of(v) for k, v in state_dict.items()},
                         {k: shape_of(v) for k, v in own.items()},
                         quantized_keys(dtypes := {k: v.dtype for k, v in state_dict.items() if shape_of(v) is not None},
                                        own), other_dtypes(dtypes, own, cast=self.cast))
        if not found:
            self.module.load_state_dict(state_dict)
            return
        if self.strict:
            raise found.refusal(self.where)
        self.skipped.extend(found.lines())
        keep = {k: v for k, v in state_dict.items() if k in own and k not in found.skipped_keys}
        self.module.load_state_dict(keep, strict=False)
