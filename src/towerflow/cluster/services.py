"""Services a :class:`~towerflow.cluster.Server` hosts for its job, found by name.

Like ``tf.train.Server``, ``Server(cluster, "ps", 0)`` must be all a ps task
needs: the article's ps does ``server.join()`` and nothing else. But the ps
shard service lives in the ``ps`` layer, *above* this one (layers are
``cli -> training -> strategies -> ps -> cluster -> devices``), so the cluster
layer may not import it. The way out is a registry of per-job services as
``"module:factory"`` strings, imported lazily when a server of that job starts
(the strategy registry in :mod:`towerflow.strategies.base` works the same
way): the cluster layer names the ps service without depending on it, a ps
task imports it only when it serves, and other jobs never load it.

A hosted service is built by ``factory(server)`` and has three methods
(:class:`HostedService`): ``handlers()`` — the gRPC services to serve;
``start()`` — called once the server listens (e.g. start watching peers);
``stop()`` — called before the server stops (stop those threads).

The services of a server are chosen by its ``services=`` argument: ``True``
(default) the ones registered for its job in :data:`JOB_SERVICES`; ``False`` /
``None`` none (only the built-in ``Ping``); or an explicit sequence of
factories or ``"module:factory"`` strings. A hosted service whose gRPC
service is already among the handlers given to the server is not hosted (the
explicit one wins), so ``Server(..., handlers=[PSService(0).handlers()])``
keeps working on a ps task.

Example:
    >>> sorted(JOB_SERVICES)
    ['ps']
    >>> load_factory("towerflow.ps.server.host:ShardHost").__name__
    'ShardHost'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from towerflow.errors import InvalidArgumentError, NotFoundError

if TYPE_CHECKING:
    import grpc

__all__ = [
    "HostedService",
    "ServiceFactory",
    "JOB_SERVICES",
    "register_service",
    "load_factory",
    "factories_for",
]


class HostedService(Protocol):
    """What a service factory returns (see the module docstring)."""

    def handlers(self) -> grpc.GenericRpcHandler | Sequence[grpc.GenericRpcHandler]:
        """The gRPC services to serve."""
        ...

    def start(self) -> None:
        """Called once the server listens."""
        ...

    def stop(self) -> None:
        """Called before the server stops; must be idempotent."""
        ...


#: builds a hosted service; called with the :class:`~towerflow.cluster.Server` that hosts it
#: (typed ``Any``: the server module imports this one, not the other way round)
ServiceFactory = Callable[[Any], HostedService]

#: job name -> the services its servers host, as "module:factory" (imported on first use)
JOB_SERVICES: dict[str, tuple[str, ...]] = {
    "ps": ("towerflow.ps.server.host:ShardHost", "towerflow.ps.server.tables.service:TableHost"),
}


def register_service(job_name: str, factory: str | ServiceFactory) -> None:
    """Host ``factory``'s service on every server of ``job_name`` started from now on.

    Args:
        job_name: the job, e.g. ``"ps"`` or ``"evaluator"``.
        factory: a ``"module:factory"`` string (checked now, imported when a
            server of the job starts) or the factory itself.

    Raises:
        InvalidArgumentError: the string is not of the form ``module:factory``.
    """
    if isinstance(factory, str):
        _split(factory)
    JOB_SERVICES[job_name] = (*JOB_SERVICES.get(job_name, ()), factory)


def _split(target: str) -> tuple[str, str]:
    module, sep, name = target.partition(":")
    if not sep or not module or not name:
        raise InvalidArgumentError(
            f"service factory {target!r} is not of the form 'package.module:factory'; "
            "name the module and the callable that builds the service."
        )
    return module, name


def load_factory(factory: str | ServiceFactory) -> ServiceFactory:
    """The factory named by ``"module:factory"`` (imported now), or ``factory`` itself.

    Raises:
        InvalidArgumentError: malformed string, or the named object is not callable.
        NotFoundError: the module or the name in it does not exist.
    """
    if not isinstance(factory, str):
        if not callable(factory):
            raise InvalidArgumentError(
                f"service factory {factory!r} is not callable; pass a callable taking the "
                "Server, or a 'module:factory' string."
            )
        return factory
    module_name, name = _split(factory)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise NotFoundError(
            f"service factory {factory!r}: module {module_name!r} cannot be imported ({exc}); "
            "install it or fix the service registry."
        ) from None
    target = getattr(module, name, None)
    if target is None:
        raise NotFoundError(
            f"service factory {factory!r}: module {module_name!r} has no {name!r}; "
            "fix the service registry."
        )
    if not callable(target):
        raise InvalidArgumentError(
            f"service factory {factory!r} names a {type(target).__name__}, which is not "
            "callable; name the callable that builds the service."
        )
    return target


def factories_for(
    job_name: str, services: bool | Sequence[str | ServiceFactory] | None
) -> tuple[str | ServiceFactory, ...]:
    """The factories a server of ``job_name`` hosts for its ``services=`` argument."""
    if services is True:
        return JOB_SERVICES.get(job_name, ())
    if services is None or services is False:
        return ()
    if isinstance(services, str | bytes):
        raise InvalidArgumentError(
            f"services={services!r}: pass a sequence of factories (e.g. [{services!r}]), "
            "True for the job's registered services or None for none."
        )
    return tuple(services)
