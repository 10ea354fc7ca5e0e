"""One gRPC server per task: ``towerflow.Server(cluster, job_name, task_index)``.

Like ``tf.train.Server``, a :class:`Server` listens on its task's address from
the cluster spec, serves the services registered for its job (on a ps task,
the ps shard service: see :mod:`~towerflow.cluster.services`), the handlers
given to it, and a built-in, authenticated ``Ping``; and it can wait for its
peers. A ps task is just ``Server(cluster, "ps", 0).join()``:

    >>> cluster = ClusterSpec({"local": ["localhost:2998", "localhost:2999"]})
    >>> server = Server(cluster, "local", 0)                    # doctest: +SKIP
    >>> server.wait_for_peers(timeout=60)                       # doctest: +SKIP
    waiting for /job:local/replica:0/task:1 at localhost:2999 (failed to connect; retrying)

A non-loopback address is served only with authentication (a cluster secret
or mutual TLS) unless the credentials say ``insecure=True``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures

import grpc

from towerflow import _identity
from towerflow.cluster.auth import RESTARTED
from towerflow.cluster.frames import FrameInterceptor
from towerflow.cluster.health import TaskHealth
from towerflow.cluster.limits import RateLimitedLog, StreamLimiter, log_by_default
from towerflow.cluster.options import ServerOptions
from towerflow.cluster.services import HostedService, ServiceFactory, factories_for, load_factory
from towerflow.cluster.spec import ClusterSpec, TaskInfo, is_loopback_host, parse_address
from towerflow.cluster.transport import (
    AuthInterceptor,
    Credentials,
    make_channel,
    raw_handlers,
    server_credentials,
    unary,
)
from towerflow.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    TowerflowError,
    UnauthenticatedError,
    UnavailableError,
)

__all__ = ["Server", "ServerOptions", "PING_METHOD", "stop_on_signals"]

logger = logging.getLogger("towerflow.cluster")

CONTROL_SERVICE = "towerflow.cluster.Control"
PING_METHOD = f"/{CONTROL_SERVICE}/Ping"


class Server:
    """The gRPC server of one task of a cluster.

    Args:
        cluster: the cluster (a :class:`ClusterSpec` or its dict form).
        job_name: this task's job.
        task_index: this task's index in its job.
        credentials: secret / TLS; ``None`` reads them from the environment
            (:meth:`Credentials.from_env`).
        start: start serving now (else call :meth:`start` after
            :meth:`add_handlers`).
        handlers: gRPC services to serve, e.g. from :func:`raw_handlers`.
        options: thread pool, message size, keepalive, heartbeats.
        services: the hosted services: True (default) those registered for
            the job (:data:`~towerflow.cluster.services.JOB_SERVICES`; a ps
            task hosts its shard), None or False none, or a sequence of
            factories / ``"module:factory"`` strings. One whose gRPC service
            is already in ``handlers`` is not hosted.

    Attributes:
        services: the hosted services (filled by :meth:`start`).

    Raises:
        InvalidArgumentError: the task is not in the cluster, or a non-loopback
            address would be served without authentication.
        NotFoundError: a hosted service's factory cannot be imported (on start).
    """

    def __init__(
        self,
        cluster: ClusterSpec | Mapping,
        job_name: str,
        task_index: int = 0,
        *,
        credentials: Credentials | None = None,
        start: bool = True,
        handlers: Sequence[grpc.GenericRpcHandler] = (),
        options: ServerOptions | None = None,
        services: bool | Sequence[str | ServiceFactory] | None = True,
    ) -> None:
        self.cluster = ClusterSpec(cluster)
        self.task = TaskInfo(job_name, task_index)
        self.address = self.cluster.task_address(job_name, task_index)
        self.credentials = Credentials.from_env() if credentials is None else credentials
        self.options = options or ServerOptions()
        self.target = f"grpc://{self.address}"
        self._host, self._port = parse_address(self.address)
        self._bind = self._bind_address()
        self.options.stream_cap()  # checked now, not when the server starts
        self._handlers: list[grpc.GenericRpcHandler] = list(handlers)
        self._factories = factories_for(job_name, services)
        self.services: tuple[HostedService, ...] = ()
        self._server: grpc.Server | None = None
        self._executor: futures.ThreadPoolExecutor | None = None  # its handlers' threads
        self._starting = threading.Lock()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._auth: AuthInterceptor | None = None
        self._warnings: RateLimitedLog | None = None  # refused calls, counted per window
        self._ended: TowerflowError | None = None
        self.streams: StreamLimiter | None = None
        self.health = TaskHealth()
        register_server(self)  # so that ``self.target`` names this task in this process
        if start:
            self.start()

    # -- lifecycle ------------------------------------------------------------
    def _bind_address(self) -> str:
        """The spec's address, or ``bind_host`` with the spec's port; checked for exposure.

        Raises:
            InvalidArgumentError: a non-loopback address without authentication,
                or without TLS, unless the credentials say ``insecure=True``.
        """
        host = self.options.bind_host
        bind = self.address if host is None else f"{_bracketed(host)}:{self._port}"
        if is_loopback_host(self._host if host is None else host):
            return bind
        creds = self.credentials
        if not creds.authenticated or creds.tls is None:
            missing = ("without authentication" if not creds.authenticated
                       else "in plaintext (without TLS)")  # fmt: skip
            if not creds.insecure:
                raise InvalidArgumentError(
                    f"refusing to serve {self.task.device_name} on non-loopback address {bind} "
                    f"{missing}; set a cluster secret (TOWERFLOW_SECRET_FILE) and TLS "
                    "(TOWERFLOW_TLS_CERT/KEY, with TOWERFLOW_TLS_CA for mutual TLS), or pass "
                    "insecure=True (towerflow server --insecure, or TOWERFLOW_INSECURE=1 for any "
                    "task) on a network you trust."
                )
            what = ("WITHOUT authentication (insecure): anyone who can reach this port can read "
                    "and change its state" if not creds.authenticated else
                    "in plaintext (insecure): calls are authenticated, but anyone on the network "
                    "can read the traffic")  # fmt: skip
            logger.warning("serving %s on %s %s", self.task.device_name, bind, what)
        return bind

    def add_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        """Add services to serve; only before :meth:`start`.

        Raises:
            FailedPreconditionError: the server is already started.
        """
        if self._server is not None:
            raise FailedPreconditionError(
                f"server of {self.task.device_name} is already started; add handlers before "
                "start() (create it with start=False)."
            )
        self._handlers.extend(handlers)

    def start(self) -> None:
        """Bind the task's address, start serving, then start the hosted services.

        No-op when already started.

        Raises:
            UnavailableError: the address cannot be bound (port taken, host not local).
            NotFoundError: a hosted service's factory cannot be imported.
        """
        with self._starting:
            if self._server is not None:
                return
            hosted = self._host_services()
            handlers = [h for _, service_handlers in hosted for h in service_handlers]
            # health first: answered without credentials, bounded apart from the training calls
            interceptors: list[grpc.ServerInterceptor] = [self.health.gate()]
            warnings = self._warnings = RateLimitedLog(logger, self.options.warning_interval)
            if self.credentials.secret:
                self._auth = AuthInterceptor(
                    self.credentials.secret, self.options.auth_freshness,
                    task=self.task.device_name, log=warnings,
                    max_message_bytes=self.options.channel.max_message_bytes,
                )  # fmt: skip
                interceptors.append(self._auth)
            self.streams = StreamLimiter(self.options.stream_cap(),
                                         self.options.max_streams_per_peer, self.task.device_name)
            interceptors.append(self.streams)
            # inside the auth check: a framed request is joined only once its call is let in
            interceptors.append(FrameInterceptor(self.options.channel.max_message_bytes,
                                                 self.task.device_name))
            self._executor = futures.ThreadPoolExecutor(
                self.options.max_workers, thread_name_prefix=f"towerflow-{self.task}")
            server = grpc.server(
                self._executor,
                interceptors=interceptors,
                options=self.options.channel.server_options(),
            )
            server.add_generic_rpc_handlers(
                (*self._handlers, *handlers, self._control_handlers())
            )
            self.health.add_to(server)
            self._add_port(server)
            server.start()
            with self._lock:
                self._server = server
                self.services = tuple(service for service, _ in hosted)
            # this process's devices are now this task's (placement log, placer)
            self._identity = _identity.register(self.task.job_name, self.task.task_index)
        announced = any(getattr(s, "announces_serving", False) for s in self.services)
        logger.log(logging.DEBUG if announced else logging.INFO,  # one start line per task
                   "started %s at %s", self.task.device_name, self.target)
        try:
            for service in self.services:
                service.start()
        except BaseException:
            self.stop(0)
            raise
        self.health.set_serving(all(_ready(service) for service in self.services))

    def _host_services(self) -> list[tuple[HostedService, list[grpc.GenericRpcHandler]]]:
        """Build the hosted services, leaving out those the given handlers already serve."""
        given = {_service_name(h) for h in self._handlers} - {None}
        hosted = []
        for factory in self._factories:
            service = load_factory(factory)(self)
            handlers = service.handlers()
            handlers = [handlers] if isinstance(handlers, grpc.GenericRpcHandler) else list(handlers)
            names = {_service_name(h) for h in handlers}
            if names and names <= given:
                logger.debug("%s: %s is served by the given handlers; not hosting %r",
                             self.task.device_name, ", ".join(sorted(names)), service)
                continue
            hosted.append((service, handlers))
        return hosted

    def _add_port(self, server: grpc.Server) -> None:
        tls = self.credentials.tls
        try:
            if tls is not None:
                port = server.add_secure_port(self._bind, server_credentials(tls))
            else:
                port = server.add_insecure_port(self._bind)
        except RuntimeError:
            port = 0
        if port == 0:
            raise UnavailableError(
                f"cannot listen on {self._bind} for {self.task.device_name}: the port is taken "
                "or the host is not an address of this machine; stop the other process, change "
                "the cluster spec, or listen on another interface (ServerOptions(bind_host=...), "
                "towerflow server --bind 0.0.0.0) when the spec names an address that is not "
                "this machine's."
            )

    def join(self, *, handle_signals: bool = True) -> None:
        """Block until the server stops: :meth:`stop` (another thread, a signal) or :meth:`end`.

        A ps task ends by itself when its job has finished (see
        ``ServerOptions.serve_forever``), so the article's ``server.join()``
        returns then.

        Args:
            handle_signals: when called in the main thread, SIGTERM and SIGINT
                (Ctrl-C) stop the server while it waits, so ``join`` returns and
                the program ends cleanly; the previous handlers are restored.

        Raises:
            TowerflowError: the task ended on an error (:meth:`end` with one),
                e.g. a ps whose workers stayed away past ``idle_timeout``.
        """
        if handle_signals and threading.current_thread() is threading.main_thread():
            with stop_on_signals(self):
                self._wait_stopped()
        else:
            self._wait_stopped()
        if self._ended is not None:
            raise self._ended

    def end(self, error: TowerflowError | None = None, *, grace: float = 1.0) -> None:
        """End the task from one of its own threads: stop the server in the background.

        Args:
            error: why the task failed (:meth:`join` raises it), None when it
                finished its work.
            grace: seconds in-flight calls get.
        """
        with self._lock:
            if self._ended is None:
                self._ended = error
        threading.Thread(target=self.stop, args=(grace,), name="towerflow-end",
                         daemon=True).start()

    def _wait_stopped(self) -> None:
        while not self._stopped.wait(1.0):
            pass

    def stop(self, grace: float | None = None) -> None:
        """Stop the hosted services, serving and the peer channels (idempotent).

        In-flight calls get ``grace`` seconds; health probes answer
        ``NOT_SERVING`` from the start.
        """
        self.health.shutdown()
        for service in reversed(self.services):
            try:
                service.stop()
            except Exception:  # noqa: BLE001 - the server must stop whatever a service does
                logger.exception("stopping %r of %s failed", service, self.task.device_name)
        with self._lock:
            server, self._server = self._server, None
            channels, self._channels = self._channels, {}
        _identity.unregister(getattr(self, "_identity", None))
        if server is not None:
            server.stop(grace).wait()
            # its handler threads end now (a busy one when its call returns), not at exit
            if self._executor is not None:
                self._executor.shutdown(wait=False)
        for channel in channels.values():
            channel.close()
        if self._warnings is not None:
            self._warnings.close()  # a refused call's count now, not from a timer left behind
        self._stopped.set()

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stopped.is_set()

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Server({self.task.device_name}, target={self.target!r})"

    # -- peers ---------------------------------------------------------------
    def channel(self, job_name: str, task_index: int) -> grpc.Channel:
        """A channel (cached, closed by :meth:`stop`) to another task, with our credentials."""
        address = self.cluster.task_address(job_name, task_index)
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = make_channel(address, self.credentials, options=self.options.channel)
                self._channels[address] = channel
            return channel

    def ping(self, job_name: str, task_index: int, *, timeout: float = 5.0) -> dict:
        """Ping a task; returns what it says about itself (``job``, ``task``, ``pid``).

        Raises:
            InvalidArgumentError: the task answering at that address is another one.
            UnavailableError, DeadlineExceededError, UnauthenticatedError: as the call.
        """
        reply = json.loads(unary(self.channel(job_name, task_index), PING_METHOD, b"", timeout=timeout))
        if (reply.get("job"), reply.get("task")) != (job_name, task_index):
            raise InvalidArgumentError(
                f"the task at {self.cluster.task_address(job_name, task_index)} is "
                f"/job:{reply.get('job')}/replica:0/task:{reply.get('task')}, not "
                f"/job:{job_name}/replica:0/task:{task_index}; give every task the same cluster "
                "spec."
            )
        return reply

    def unanswering(self, tasks: Sequence[TaskInfo], timeout: float = 2.0) -> list[str]:
        """Of ``tasks``, those that do not answer a ping now, each named with why (in parallel).

        Example: ``['/job:worker/replica:0/task:1 at localhost:2223 (no connection: it is not
        running)']``.
        """

        def probe(task: TaskInfo) -> str | None:
            where = f"{task.device_name} at {self.cluster.task_address(task.job_name, task.task_index)}"
            try:
                self.ping(task.job_name, task.task_index, timeout=timeout)
            except UnavailableError:
                return f"{where} (no connection: it is not running)"
            except DeadlineExceededError:
                return f"{where} (no reply within {timeout:g} s: it is suspended or hung)"
            except (TowerflowError, ValueError) as exc:
                return f"{where} ({exc})"
            return None

        if not tasks:
            return []
        with futures.ThreadPoolExecutor(min(16, len(tasks)),
                                        thread_name_prefix="towerflow-probe") as pool:
            return [found for found in pool.map(probe, tasks) if found is not None]

    def wait_for_peers(self, jobs: Sequence[str] | None = None, timeout: float = 60.0) -> None:
        """Wait until every task of ``jobs`` (default: all) but this one answers a ping.

        Logs ``waiting for /job:worker/replica:0/task:1 at localhost:2223 (failed to
        connect; retrying)`` for each missing task, retrying with backoff.

        Raises:
            UnavailableError: some tasks did not answer within ``timeout`` seconds
                (the message names them).
            UnauthenticatedError: a peer refused this task's credentials.
        """
        for job in jobs or ():
            self.cluster.num_tasks(job)  # validates the job name
        pending = [
            (task, address)
            for task, address in self.cluster.tasks()
            if task != self.task and (jobs is None or task.job_name in jobs)
        ]
        deadline = time.monotonic() + timeout
        backoff = 0.1
        reasons: dict[TaskInfo, str] = {}
        while pending:
            for task, address in pending:
                per_call = max(0.05, min(2.0, deadline - time.monotonic()))
                reasons[task] = self._probe(task, per_call)
                if reasons[task]:
                    log_by_default(logger, logging.INFO, "waiting for %s at %s (%s; retrying)",
                                   task.device_name, address, reasons[task])
            pending = [(t, a) for t, a in pending if reasons[t]]
            remaining = deadline - time.monotonic()
            if pending and (remaining <= 0 or self._stopped.wait(min(backoff, remaining))):
                missing = ", ".join(f"{t.device_name} at {a} ({reasons[t]})" for t, a in pending)
                raise UnavailableError(
                    f"{self.task.device_name} gave up after {timeout:g} s waiting for {missing}; "
                    "start those tasks or check the cluster spec and their addresses."
                )
            backoff = min(backoff * 2, 2.0)

    def _probe(self, task: TaskInfo, timeout: float) -> str:
        try:
            self.ping(task.job_name, task.task_index, timeout=timeout)
        except UnauthenticatedError:
            raise
        except UnavailableError as exc:
            return "restarted" if RESTARTED in str(exc) else "failed to connect"
        except DeadlineExceededError:
            return "no reply before the deadline"
        except InvalidArgumentError:
            raise
        except TowerflowError as exc:
            return str(exc)
        return ""

    def _control_handlers(self) -> grpc.GenericRpcHandler:
        identity = json.dumps(
            {"job": self.task.job_name, "task": self.task.task_index, "pid": os.getpid()}
        ).encode()
        return raw_handlers(CONTROL_SERVICE, {"Ping": ("unary_unary", lambda _request: identity)})


# -- the live servers of this process, found by address (what ``server.target`` names)
_LOCK = threading.Lock()
_SERVERS: weakref.WeakSet[Server] = weakref.WeakSet()


def register_server(server: Server) -> None:
    """Record a server of this process so that its ``target`` finds it."""
    with _LOCK:
        _SERVERS.add(server)


def address_key(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``address``, with every name of this machine's loopback one."""
    host, port = parse_address(address)
    host = host.lower()
    return ("127.0.0.1" if host in ("localhost", "::1") else host), port


def server_at(target: str) -> Server | None:
    """The live (not stopped) server of this process whose address is ``target``."""
    key = address_key(target)
    with _LOCK:
        servers = list(_SERVERS)
    for server in servers:
        if not server.stopped and address_key(server.address) == key:
            return server
    return None


def _ready(service: HostedService) -> bool:
    """Whether a hosted service is ready (one without ``ready()`` is, once started)."""
    ready = getattr(service, "ready", None)
    return bool(ready()) if callable(ready) else True


def _bracketed(host: str) -> str:
    """An IPv6 literal in brackets, as a gRPC address needs it (``::`` -> ``[::]``)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _service_name(handler: grpc.GenericRpcHandler) -> str | None:
    """The gRPC service a generic handler serves, when it says (grpc's dictionary handlers do)."""
    name = getattr(handler, "service_name", None)
    return name() if callable(name) else None


@contextlib.contextmanager
def stop_on_signals(
    server: Server, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)
) -> Iterator[Server]:
    """Within the block, SIGTERM / SIGINT stop ``server`` (so :meth:`Server.join` returns).

    Must be entered in the main thread; the previous handlers are restored on exit.
    """
    with stop_on_signals_from_now(signals) as bind:
        bind(server)
        yield server


@contextlib.contextmanager
def stop_on_signals_from_now(
    signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)
) -> Iterator[Callable[[Server], None]]:
    """SIGTERM / SIGINT from the start of the block stop the server given to ``bind``.

    Enter it before building the server: a server listens as soon as it is
    built, so a signal that comes before :meth:`Server.join` would otherwise
    end the process with the signal's default action. A signal that arrives
    before ``bind`` stops the server as soon as it is bound. Outside the main
    thread no handler is installed (Python allows none there) and ``bind``
    does nothing. The previous handlers are restored on exit.

    Example:
        >>> with stop_on_signals_from_now() as bind:   # doctest: +SKIP
        ...     server = Server(cluster, "ps", 0)
        ...     bind(server)
        ...     server.join(handle_signals=False)
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda server: None
        return
    requested = threading.Event()
    bound: list[Server] = []

    def stop(server: Server) -> None:
        threading.Thread(target=server.stop, name="towerflow-stop", daemon=True).start()

    def handle(signum: int, frame: object) -> None:
        requested.set()
        for server in bound:
            logger.info("%s received signal %d; stopping", server.task.device_name, signum)
            stop(server)

    def bind(server: Server) -> None:
        bound.append(server)
        if requested.is_set():
            stop(server)

    previous = {sig: signal.getsignal(sig) for sig in signals}
    try:
        for sig in signals:
            signal.signal(sig, handle)
        yield bind
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
