"""Every task's address from torchrun's rendezvous store.

torchrun's agents meet in a rendezvous and keep a ``TCPStore`` open for the
whole job; its workers find it at ``MASTER_ADDR:MASTER_PORT`` and, when
``TORCHELASTIC_USE_AGENT_STORE=True`` (what torchrun sets for its ``static``
and ``c10d`` rendezvous), connect to it as clients. Each process publishes the
address its task listens on under a key of its run (``TORCHELASTIC_RUN_ID``),
its restart (``TORCHELASTIC_RESTART_COUNT``) and its rank, and reads those of
the other ranks, waiting a bounded time (``TOWERFLOW_RENDEZVOUS_TIMEOUT``
seconds, default 300) that names the ranks still missing when it runs out. No
node's host has to be written by hand: a rank's host is the local address of
its route to the store, the interface its node reaches the other nodes from.

The store is not trusted: whoever reaches it can write any key. With a cluster
secret (``TOWERFLOW_SECRET`` / ``TOWERFLOW_SECRET_FILE``) every entry carries
an HMAC-SHA256 over its key and address, checked on read, so an address no
secret holder published is refused (``UnauthenticatedError`` naming the
rank); without a secret the addresses cannot be authenticated and a warning
says so.

Example:
    >>> address_key({"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "1"}, 3)
    'towerflow/job7/restart1/address/3'
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import logging
import socket
from collections.abc import Mapping

from towerflow.cluster.transport import Credentials
from towerflow.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    UnauthenticatedError,
    UnavailableError,
)

__all__ = [
    "TIMEOUT_ENV",
    "DEFAULT_TIMEOUT_S",
    "address_key",
    "uses_agent_store",
    "route_host",
    "format_address",
    "exchange_addresses",
    "own_address",
    "same_host",
    "sign_entry",
    "open_entry",
]

logger = logging.getLogger("towerflow.cluster")

#: seconds a rank waits for every other rank's address in the store
TIMEOUT_ENV = "TOWERFLOW_RENDEZVOUS_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0


def uses_agent_store(env: Mapping[str, str]) -> bool:
    """Whether torchrun's agent hosts a store this worker may join at ``MASTER_ADDR:MASTER_PORT``."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def address_key(env: Mapping[str, str], rank: int) -> str:
    """The store key of ``rank``'s address in this run and restart."""
    run = env.get("TORCHELASTIC_RUN_ID") or "none"
    restart = env.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return f"towerflow/{run}/restart{restart}/address/{rank}"


def _entry_mac(secret: bytes, key: str, address: str) -> str:
    return hmac.new(secret, f"rendezvous\n{key}\n{address}".encode(), hashlib.sha256).hexdigest()


def sign_entry(secret: bytes | None, key: str, address: str) -> str:
    """The store value of ``address`` under ``key``: ``"<address> <mac>"``, or the bare address
    without a secret."""
    return address if not secret else f"{address} {_entry_mac(secret, key, address)}"


def open_entry(secret: bytes | None, key: str, value: str, where: str = "the store") -> str:
    """The address in a store ``value``, its MAC checked when there is a secret.

    Raises:
        UnauthenticatedError: with a secret, the entry carries no MAC or a wrong one.
    """
    if not secret:
        return value
    address, _, mac = value.partition(" ")
    if not hmac.compare_digest(_entry_mac(secret, key, address).encode(), mac.encode()):
        shown = value[:80] + ("..." if len(value) > 80 else "")
        raise UnauthenticatedError(
            f"the address {shown!r} under {key} in {where} is not signed with this cluster's "
            "secret (someone without the secret wrote it, or the task holds another secret); "
            "refusing it. Give every rank the same cluster secret (TOWERFLOW_SECRET_FILE) and "
            "let only the job's ranks reach the store."
        )
    return address


def format_address(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets.

    Example:
        >>> format_address("::1", 2222), format_address("10.0.0.2", 2222)
        ('[::1]:2222', '10.0.0.2:2222')
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def route_host(master_addr: str, master_port: int) -> str:
    """The local address this host reaches ``master_addr`` from (no packet is sent).

    Raises:
        UnavailableError: ``master_addr`` does not resolve or has no route.
    """
    try:
        infos = socket.getaddrinfo(master_addr, master_port, type=socket.SOCK_DGRAM)
        family, kind, proto, _, where = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(where)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise UnavailableError(
            f"MASTER_ADDR={master_addr} (torchrun's rendezvous store) cannot be reached from "
            f"this host ({exc}); check the --rdzv-endpoint / --master-addr torchrun was given."
        ) from None


def _timeout(env: Mapping[str, str]) -> float:
    text = env.get(TIMEOUT_ENV) or str(DEFAULT_TIMEOUT_S)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise InvalidArgumentError(
            f"{TIMEOUT_ENV}={text!r} is not a positive number of seconds; set it to how long a "
            "rank waits for the others' addresses."
        )
    return seconds


def exchange_addresses(env: Mapping[str, str], rank: int, world: int, address: str,
                       timeout_s: float | None = None) -> list[str]:
    """Publish ``address`` as ``rank``'s in torchrun's store; return every rank's, in rank order.

    Args:
        env: torchrun's environment (``MASTER_ADDR``, ``MASTER_PORT``,
            ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``).
        rank: this process's ``RANK``.
        world: ``WORLD_SIZE``.
        address: where this rank's task listens (``host:port``).
        timeout_s: how long to wait for the store and the other ranks
            (default ``TOWERFLOW_RENDEZVOUS_TIMEOUT``, else 300).

    Raises:
        UnavailableError: the store does not answer.
        DeadlineExceededError: some ranks published no address in time (named).
        UnauthenticatedError: with a cluster secret, an address in the store is
            not signed with it.
    """
    import torch.distributed as dist

    secret = Credentials.from_env(env).secret
    if not secret:
        logger.warning("the addresses in torchrun's rendezvous store cannot be authenticated "
                       "without a cluster secret: whoever reaches the store can redirect this "
                       "rank's calls; set TOWERFLOW_SECRET_FILE on every rank.")
    seconds = _timeout(env) if timeout_s is None else timeout_s
    host, port = env.get("MASTER_ADDR") or "localhost", int(env.get("MASTER_PORT") or 0)
    where = f"torchrun's rendezvous store at {format_address(host, port)}"
    try:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=seconds))
        store.set(address_key(env, rank), sign_entry(secret, address_key(env, rank), address))
    except RuntimeError as exc:
        raise UnavailableError(
            f"{where} does not answer ({exc}); start this process with torchrun, or set "
            "TOWERFLOW_HOSTS and TORCHELASTIC_USE_AGENT_STORE=False to name the node hosts."
        ) from None
    keys = [address_key(env, r) for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=seconds))
    except RuntimeError:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if missing:
            raise DeadlineExceededError(
                f"rank(s) {missing} of {world} published no address in {where} (keys "
                f"{address_key(env, missing[0])}...) within {seconds:g} s; start every node's "
                f"torchrun with the same towerflow program, or raise {TIMEOUT_ENV}."
            ) from None
    return [open_entry(secret, key, store.get(key).decode(errors="replace"), where)
            for key in keys]


def _ips(host: str) -> set[str]:
    try:
        return {str(ipaddress.ip_address(info[4][0].split("%")[0]))
                for info in socket.getaddrinfo(host, None)}
    except (OSError, ValueError):
        return set()


def same_host(a: str, b: str) -> bool:
    """Whether host names or addresses ``a`` and ``b`` name one host (equal, or an address shared).

    Example:
        >>> same_host("127.0.0.1", "localhost"), same_host("127.0.0.1", "127.0.0.2")
        (True, False)
    """
    return a == b or bool(_ips(a) & _ips(b))


def own_address(env: Mapping[str, str], port: int) -> str:
    """This rank's ``host:port``: its route's local address to the store, and ``port``."""
    master = env.get("MASTER_ADDR") or "localhost"
    return format_address(route_host(master, int(env.get("MASTER_PORT") or 0)), port)
