"""Op placement: ``towerflow.device`` scopes, the placer mode and soft placement.

``with towerflow.device("/gpu:1"):`` makes the operations inside run on GPU 1:

* factory functions (``torch.zeros``, ``torch.tensor``, the parameters of a
  module built inside) create their tensors there unless given a ``device``;
* a computing operation whose inputs live elsewhere gets them copied to the
  scope's device first (the copy shows in the placement log);
* in-place operations (``add_``, ``out=``) run where the tensor they change
  lives, and device-neutral calls (``.to``, ``.item()``, ``.size()``,
  attribute access) are left alone.

Scopes nest: the inner spec is merged into the outer one (``make_merged_spec``,
inner fields win), and ``device(None)`` clears every outer scope. A scope may
also be a device function (``towerflow.device(towerflow.replica_device_setter(
cluster=cluster))``, see :mod:`towerflow.devices.functions`), asked per
operation.

The job, replica and task of a spec say which process runs the operation.
This process is its cluster task (registered by ``towerflow.Server``) or
``/job:localhost/replica:0/task:0``; an operation placed on another task is
refused with a ``PlacementError`` that names the task, since towerflow runs
work only in its own task's process. One exception follows TensorFlow's
variables: under a scope naming a ``ps`` task, tensors may be created and
parameters built and initialised; the parameters are recorded as assigned to
that ps task (:func:`towerflow.devices.params.parameter_placements`) and the
parameter-server strategy keeps them there.

Inside code being compiled by ``torch.compile`` the placer steps aside (the
compiled module is logged as one region, see :mod:`towerflow.devices.log`): the
first thing the mode asks is whether dynamo is tracing it, so that nothing of
the placer's state (the kind cache below, the thread's scopes) is read in a
traced frame. Were it read, dynamo would guard the compiled code on it, on the
size of the kind cache for one, which grows as operations are met, and the
compiled module would be recompiled, or refused, whenever that state changed.

The placer is a :class:`torch.overrides.TorchFunctionMode` pushed onto the
current thread's mode stack only while a scope is open, the placement log is
on, or a default device is configured; otherwise nothing is installed and
PyTorch runs untouched. Scopes are per thread, like PyTorch's mode stack. Per
operation the placer pays a call of ``torch.compiler.is_dynamo_compiling`` (a
function returning ``False`` outside dynamo), a dictionary lookup (the
operation's kind is classified once and cached) and a device check of each
tensor argument.
Which device a scope's spec names, and moving inputs there, is
:mod:`towerflow.devices.targets`'s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from towerflow import _identity
from towerflow.devices import functions as _functions
from towerflow.devices import grads as _grads
from towerflow.devices import loglines as _lines
from towerflow.devices import params as _params
from towerflow.devices import settings as _settings
from towerflow.devices.local import full_name, gpu_count
from towerflow.devices.messages import missing_message as _missing_message
from towerflow.devices.messages import remote_message as _remote_message
from towerflow.devices.spec import DeviceSpec
from towerflow.devices.targets import (
    CPU,
    DYNAMIC,
    NO_TARGET,
    Target,
    check_default_device,
    default_target,
    full_spec,
    move,
    no_kernel,
    resolve_spec,
    result_device,
    target_for,
    wrong_device,
    wrong_in,
)
from towerflow.errors import PlacementError

__all__ = [
    "device", "resolve_device", "current_scope", "refresh_global", "check_default_device",
]

_FACTORY, _NEUTRAL, _INPLACE, _COMPUTE, _BACKWARD = range(5)

_FACTORY_NAMES = (
    "empty", "empty_permuted", "empty_strided", "zeros", "ones", "full", "arange", "range",
    "linspace", "logspace", "eye", "rand", "randn", "randint", "randperm", "tensor",
    "as_tensor", "asarray", "scalar_tensor", "tril_indices", "triu_indices",
    "bartlett_window", "blackman_window", "hamming_window", "hann_window", "kaiser_window",
    "sparse_coo_tensor", "sparse_csr_tensor",
)
_NEUTRAL_NAMES = frozenset({
    "__get__", "__set__", "__delete__", "to", "cpu", "cuda", "type", "type_as", "numpy",
    "item", "tolist", "size", "dim", "ndimension", "numel", "nelement", "element_size",
    "stride", "storage_offset", "is_contiguous", "is_floating_point", "is_complex",
    "data_ptr", "untyped_storage", "get_device", "__repr__", "__str__", "__format__",
    "__len__", "__bool__", "__int__", "__float__", "__index__", "__hash__", "__reduce_ex__",
    "__deepcopy__", "__setstate__", "__getstate__", "__array__", "__array_wrap__",
    "__dlpack__", "__dlpack_device__", "__contains__", "backward", "register_hook",
    "register_post_accumulate_grad_hook", "retain_grad", "requires_grad_", "detach",
    "detach_", "pin_memory", "is_pinned", "share_memory_", "is_shared", "new_empty",
    "new_zeros", "new_ones", "new_full", "new_tensor", "new_empty_strided", "_is_view",
    "is_set_to", "dtype", "device", "shape", "is_nonzero", "equal",
    # autograd and profiler switches: no tensor work
    "_set_grad_enabled", "set_grad_enabled", "is_grad_enabled", "_enter_autocast",
    "_exit_autocast", "_record_function_enter", "_record_function_enter_new",
    "_record_function_exit", "_RecordFunction",
})
_BACKWARD_FUNCS = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})
_INPLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
    "__irshift__",
})
_FACTORIES: frozenset[Callable[..., Any]] = frozenset(
    getattr(torch, name) for name in _FACTORY_NAMES if hasattr(torch, name)
)
# Filled as operations are met; never read while dynamo traces (see _Placer).
_KINDS: dict[Callable[..., Any], int] = {}
# a module global: one call, no attribute lookups, per operation; dynamo recognises the
# function itself (not its name) and folds it to True while it traces
_tracing = torch.compiler.is_dynamo_compiling


def _kind(func: Callable[..., Any]) -> int:
    kind = _KINDS.get(func)
    if kind is None:
        name = (getattr(func, "__name__", None) or "").rsplit(".", 1)[-1]
        if func in _FACTORIES:
            kind = _FACTORY
        elif func in _BACKWARD_FUNCS:
            kind = _BACKWARD
        elif name in _NEUTRAL_NAMES or "profiler" in (getattr(func, "__module__", "") or ""):
            kind = _NEUTRAL
        elif name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__")):
            kind = _INPLACE
        else:
            kind = _COMPUTE
        _KINDS[func] = kind
    return kind


class _Scope:
    """One open scope: the scopes it is made of since the last ``device(None)``."""

    __slots__ = ("chain", "spec", "dynamic", "source")

    def __init__(self, chain: tuple[_functions.ScopeItem, ...], spec: DeviceSpec | None,
                 dynamic: bool, source: Any) -> None:
        self.chain = chain      # outermost first
        self.spec = spec        # the merged spec (when no device function is in the chain)
        self.dynamic = dynamic  # a device function is in the chain
        self.source = source    # the innermost device function, else the merged spec


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.scopes: list[_Scope] = []
        self.mode: _Placer | None = None
        self.users = 0
        self.global_held = False
        self.target: Target = NO_TARGET
        self.generation = -1
        self.identity = -1
        self.targets: dict[DeviceSpec | None, Target] = {}  # device functions' answers
        self.fast: int | None = None  # the target's index when _Placer's fast path applies


_state = _ThreadState()


def _refresh(state: _ThreadState) -> Target:
    config = _settings.get_config()
    scope = state.scopes[-1] if state.scopes else None
    state.targets = {}
    if scope is not None and scope.dynamic:
        state.target = DYNAMIC
    else:
        state.target = resolve_spec(scope.spec if scope is not None else None, config)
    target = state.target
    plain = (target is not DYNAMIC and target.device is not None and not target.remote
             and not target.missing and not config.log_device_placement)
    state.fast = target.index if plain else None
    state.generation = _settings.generation()
    state.identity = _identity.generation()
    return state.target


def _current(state: _ThreadState) -> Target:
    # module attributes read directly: this runs for every operation
    if state.generation == _settings._generation and state.identity == _identity._generation:
        return state.target
    return _refresh(state)


def _dynamic_target(state: _ThreadState, func: Any) -> Target:
    """Ask the scope's device functions where ``func`` goes (answers cached per device)."""
    chain = state.scopes[-1].chain
    spec = _functions.evaluate(chain, _lines.OpNamer.peek(func), _lines.python_name(func))
    target = state.targets.get(spec)
    if target is None:
        target = resolve_spec(spec, _settings.get_config())
        state.targets[spec] = target
    return target


def _on_parameter(module: torch.nn.Module, name: str, param: torch.Tensor) -> None:
    """A parameter was registered: name its creation in the log, record its device."""
    entry = _params.owner_of(param)
    if entry is None:
        return
    if _settings.get_config().log_device_placement:
        _lines.claim(param, entry)
    scopes = _state.scopes
    scope = scopes[-1] if scopes else None
    if scope is None or not scope.chain:
        return
    if scope.dynamic:
        spec = _functions.evaluate(scope.chain, name, _functions.VARIABLE_TYPE,
                                   tuple(param.shape))
    else:
        spec = scope.spec
    if spec is not None and (spec.job is not None or spec.task is not None):
        _params.assign(param, full_spec(spec), scope.source)


def _acquire(state: _ThreadState) -> None:
    if state.users == 0:
        mode = _Placer()
        mode.__enter__()
        state.mode = mode
        _params.install(_on_parameter)
    state.users += 1


def _release(state: _ThreadState) -> None:
    state.users -= 1
    if state.users == 0 and state.mode is not None:
        mode, state.mode = state.mode, None
        try:
            mode.__exit__(None, None, None)
        finally:
            _params.uninstall()


def refresh_global() -> None:
    """Install or remove the placer for the settings (log on, default device)."""
    state = _state
    config = _settings.get_config()
    needed = config.log_device_placement or default_target(config).device is not None
    if needed and not state.global_held:
        _acquire(state)
        state.global_held = True
    elif not needed and state.global_held:
        state.global_held = False
        _release(state)
    _refresh(state)


_Spec = str | DeviceSpec | torch.device | None


class _DeviceScope:
    """The context manager returned by :func:`device`."""

    __slots__ = ("_item", "_depth")

    def __init__(self, spec: _Spec | Callable[..., Any]) -> None:
        if spec is not None and callable(spec) and not isinstance(spec, (str, torch.device)):
            self._item: _functions.ScopeItem | None = spec
        else:
            self._item = None if spec is None else DeviceSpec.from_string(spec)
        self._depth: list[int] = []

    def _scope(self, outer: _Scope | None) -> _Scope:
        item = self._item
        if item is None:
            return _Scope((), None, False, None)
        chain = (*outer.chain, item) if outer is not None else (item,)
        if isinstance(item, DeviceSpec) and (outer is None or not outer.dynamic):
            spec = item if outer is None or outer.spec is None else \
                outer.spec.make_merged_spec(item)
            return _Scope(chain, spec, False, spec)
        source = item if not isinstance(item, DeviceSpec) else outer.source  # type: ignore[union-attr]
        return _Scope(chain, None, True, source)

    def __enter__(self) -> DeviceSpec | None:
        state = _state
        scope = self._scope(state.scopes[-1] if state.scopes else None)
        state.scopes.append(scope)
        self._depth.append(len(state.scopes))
        _acquire(state)
        _refresh(state)
        return scope.spec  # None under a device function: it decides per operation

    def __exit__(self, *exc_info: object) -> None:
        state = _state
        _lines.flush()  # a model built in the scope: its parameters' lines, named now
        try:
            depth = self._depth.pop()
            del state.scopes[depth - 1:]
        finally:
            _release(state)
            _refresh(state)


def device(spec: _Spec | Callable[..., Any]) -> _DeviceScope:
    """Open a placement scope: operations inside run on ``spec``'s device.

    Args:
        spec: a device name (``"/gpu:1"``, ``"/cpu:0"``, ``"cuda:0"``,
            ``"/job:worker/task:1/gpu:0"``), a ``DeviceSpec``, a ``torch.device``,
            ``None`` to clear the outer scopes, or a device function (a callable
            taking an :class:`~towerflow.devices.functions.Operation` and returning
            a device name), such as ``towerflow.replica_device_setter(...)``.

    Raises:
        InvalidArgumentError: ``spec`` is malformed (raised here, at the ``with``).
        PlacementError: at the first operation, when the device does not exist
            and ``allow_soft_placement`` is off, or belongs to another task.

    Example:
        >>> with device("/cpu:0"):
        ...     torch.ones(2).device
        device(type='cpu')
    """
    return _DeviceScope(spec)


def current_scope() -> DeviceSpec | None:
    """Return the merged spec of the innermost open scope (``None`` when none or cleared).

    Under a device function, the device it gives an operation of no particular type.
    """
    scopes = _state.scopes
    if not scopes:
        return None
    scope = scopes[-1]
    if scope.dynamic:
        return _functions.evaluate(scope.chain, "", "")
    return scope.spec


def resolve_device(spec: str | DeviceSpec | torch.device | None = None) -> torch.device:
    """Turn a user's device name into an existing ``torch.device``.

    ``None`` (or a spec naming only a job/task) gives the device new tensors go
    to here: the current scope's, else the configured default, else the
    lowest-numbered visible GPU, else the CPU.

    Raises:
        InvalidArgumentError: the name is malformed.
        PlacementError: the device does not exist and soft placement is off
            (with it, the CPU is returned).

    Example:
        >>> resolve_device("/cpu:0")
        device(type='cpu')
    """
    parsed = DeviceSpec.from_string(spec)
    if parsed.device_type is None:
        target = _current(_state)
        if target is DYNAMIC:
            target = resolve_spec(current_scope(), _settings.get_config())
        if target.device is not None and not target.remote:
            return target.device
        return torch.device("cuda", 0) if gpu_count() else CPU
    target = target_for(parsed, _settings.get_config().allow_soft_placement)
    if target.missing:
        raise PlacementError(_missing_message(f"device {str(spec)!r}", parsed))
    return target.device  # type: ignore[return-value]


class _Placer(TorchFunctionMode):
    """Puts every operation on the device of the current thread's scope."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        # Traced by dynamo (torch.compile with a scope or the log on): step aside before
        # any of the placer's state is read, or dynamo guards the compiled code on it
        # (the size of _KINDS, which grows as operations are met: a guard that fails and
        # recompiles, or fails as it is built, whenever an operation is first classified).
        if _tracing():
            return func(*args, **kwargs) if kwargs else func(*args)
        # The fast path (runs for every operation of a training step under a scope): a
        # neutral or in-place operation, or a computation whose inputs are all on the
        # scope's device, in a scope of one local device with the log off.
        kind = _KINDS.get(func)
        if kind == _NEUTRAL:
            return func(*args, **kwargs) if kwargs else func(*args)
        state = _state
        index = state.fast
        if index is not None and state.generation == _settings._generation \
                and state.identity == _identity._generation:
            if kind == _INPLACE:
                return func(*args, **kwargs) if kwargs else func(*args)
            if kind == _COMPUTE and not (kwargs and ("out" in kwargs
                                                     or wrong_in(kwargs.values(), index))) \
                    and not wrong_in(args, index):
                try:
                    return func(*args, **kwargs) if kwargs else func(*args)
                except (NotImplementedError, RuntimeError) as exc:
                    target = state.target
                    if not no_kernel(exc, target):
                        raise
                    return _kernel_fallback(func, args, kwargs or {}, target, False, exc, "")
        return self._place(func, kind, args, kwargs or {})

    def _place(self, func: Any, kind: int | None, args: Any, kwargs: dict[str, Any]) -> Any:
        """Every other case: scopes of device functions or other tasks, the log, copies."""
        if kind is None:
            kind = _kind(func)
        if kind == _NEUTRAL or torch.compiler.is_compiling():
            return func(*args, **kwargs)
        state = _state
        target = _current(state)
        logging_on = _settings.get_config().log_device_placement
        if kind == _BACKWARD:
            return _grads.run_backward(func, args, kwargs) if logging_on \
                else func(*args, **kwargs)
        if target is DYNAMIC:
            target = _dynamic_target(state, func)
        if target.device is None and not logging_on and not target.remote:
            return func(*args, **kwargs)
        if kind == _INPLACE or (kind == _COMPUTE and "out" in kwargs):
            return _run_inplace(func, args, kwargs) if logging_on else func(*args, **kwargs)
        if target.remote:
            if kind != _FACTORY or not target.ps:
                raise PlacementError(_remote_message(
                    f"operation '{_lines.OpNamer.peek(func)}'", target))
            return _run_logged(func, args, kwargs, target, logging_on)
        if target.device is None:
            return _run_logged(func, args, kwargs, None, logging_on)
        if target.missing:
            raise PlacementError(_missing_message(f"operation '{_lines.OpNamer.peek(func)}'",
                                                  target.spec))  # type: ignore[arg-type]
        if kind == _FACTORY:
            if kwargs.get("device") is None:
                kwargs = {**kwargs, "device": target.device}
            return _run_logged(func, args, kwargs, target, logging_on)
        return _run_compute(func, args, kwargs, target, logging_on)


def _run_compute(func: Any, args: Any, kwargs: dict[str, Any], target: Target,
                 logging_on: bool) -> Any:
    name = _lines.OpNamer.name(func) if logging_on else ""
    if wrong_device(args, kwargs, target.index):
        copies: list[torch.device] = []
        args = move(args, target.device, target.index, copies)  # type: ignore[arg-type]
        kwargs = {k: move(v, target.device, target.index, copies)  # type: ignore[arg-type]
                  for k, v in kwargs.items()}
        for number, source in enumerate(copies if logging_on else ()):
            suffix = "input_copy" if number == 0 else f"input_copy_{number}"
            _lines.log_op(f"{name}/{suffix}", "aten::_to_copy",
                        full_name(target.device),  # type: ignore[arg-type]
                        f" (from {full_name(source)})")
    try:
        return _run_logged(func, args, kwargs, target, logging_on, name)
    except (NotImplementedError, RuntimeError) as exc:
        if not no_kernel(exc, target):
            raise
        return _kernel_fallback(func, args, kwargs, target, logging_on, exc, name)


def _kernel_fallback(func: Any, args: Any, kwargs: dict[str, Any], target: Target,
                     logging_on: bool, exc: BaseException, name: str) -> Any:
    device_type = "GPU" if target.index >= 0 else "CPU"
    if not target.soft or target.index < 0:
        spec = target.spec.to_string() if target.spec is not None else device_type
        reason = str(exc).splitlines()[0]
        raise PlacementError(
            f"Cannot assign a device for operation '{name or _lines.OpNamer.peek(func)}': Could not "
            f"satisfy explicit device specification '{spec}' because no supported kernel for "
            f"{device_type} devices is available ({reason}). Set allow_soft_placement=True to "
            f"run it on the CPU instead."
        ) from exc
    copies: list[torch.device] = []
    args = move(args, CPU, -1, copies)
    kwargs = {k: move(v, CPU, -1, copies) for k, v in kwargs.items()}
    soft = Target(CPU, target.spec, note=f" (soft placement: no {device_type} kernel)")
    return _run_logged(func, args, kwargs, soft, logging_on, name)


def _run_inplace(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """An in-place operation, logged; one on a parameter or buffer is named after it."""
    changed = args[0] if args else next(iter(kwargs.values()), None)
    entry = _params.owner_of(changed)
    recorder = _lines.AtenRecorder()
    with recorder:
        result = func(*args, **kwargs)
    device_name = full_name(result_device(result, None))
    if entry is not None:
        _lines.log_tensor_op(entry, func, recorder.aten_name(result, _lines.python_name(func)),
                           device_name)
    else:
        name = _lines.OpNamer.name(func)
        _lines.log_op(name, recorder.aten_name(result, name), device_name)
    return result


def _run_logged(func: Any, args: Any, kwargs: dict[str, Any], target: Target | None,
                logging_on: bool, name: str = "") -> Any:
    if not logging_on:
        return func(*args, **kwargs)
    name = name or _lines.OpNamer.name(func)
    recorder = _lines.AtenRecorder()
    with recorder:
        result = func(*args, **kwargs)
    note = target.note if target is not None else ""
    aten = recorder.aten_name(result, name)
    if target is not None and target.remote:
        _lines.hold_op(name, aten, target.remote, note, result)
    elif _KINDS.get(func) == _FACTORY:
        fallback = target.device if target is not None else None
        _lines.hold_op(name, aten, full_name(result_device(result, fallback)), note, result)
    else:
        fallback = target.device if target is not None else None
        _lines.log_op(name, aten, full_name(result_device(result, fallback)), note)
        _grads.hook_result(name, result)
    return result
