"""A step's dense push carried by the next step's table pull (``ParameterServer``, async).

An async click model's step sends each ps task its rows' pull with the last
step's row gradients (deferred pushes); its dense layers would cost each ps
task a second request per step. :class:`DenseCarrier` keeps the step's dense
push, encoded (:meth:`~towerflow.ps.worker.dense.client.PSClient.prepare_push`),
until the next forward: the tables pull ahead of it (the prefetcher, for one
table too), and each ps task's request carries the push
(``RowBatchRequest.dense``); the replies bring the fresh dense parameters,
written into the model before its forward runs. A forward that does not pull
ahead (the ids not predicted) gets the push sent alone first (a forward
pre-hook after the prefetcher's). A step with no forward of the model (a loss
function that calls its parts) shows it cannot work: the carrier stops with
one warning and the strategy pushes each step's dense part itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["DenseCarrier"]

log = logging.getLogger("towerflow.ps")


class DenseCarrier:
    """Carries each step's dense push with the next step's table pull.

    Args:
        model: the prepared model (its forward gets the pre-hook).
        tables: the model's ``SparseTables``.
        client: the ``PSClient``.
        adopt: ``adopt(result_of)``: the strategy takes ``result_of()`` (a
            ``PushResult``; the fresh parameters are in ``pull_into`` by then).
        pull_into: the host parameter arrays the replies are written into.
    """

    def __init__(self, model: nn.Module, tables: Any, client: Any,
                 adopt: Callable[[Callable[[], Any]], None], pull_into: Any) -> None:
        self._tables, self._client, self._adopt, self._into = tables, client, adopt, pull_into
        tables.pull_ahead_always(model)
        self._hook: Any = model.register_forward_pre_hook(self._before_forward)
        log.info("the dense push of each step travels with the next step's table pull: one "
                 "request per ps task and step")

    @staticmethod
    def wanted(tables: Any, client: Any, aggregation: Any) -> bool:
        """Whether a model can carry its dense pushes: async, tables that all defer their
        pushes, every dense shard one message."""
        return bool(tables) and aggregation.mode == "async" \
            and all(module.defer_push for _, module in tables.modules) \
            and all(shard.small for shard in client.shards)

    def carry(self, grads: Any, lr: float) -> bool:
        """Keep this step's dense push (``grads``, copied now) for the next forward's pull.

        False: the last step's push was left to this one (the model's forward
        did not run); it is sent now and the carrier stops: push ``grads``
        yourself, now and from now on.
        """
        if self.send():
            self.close()
            log.warning("the dense push goes in its own request each step: the loss function "
                        "does not call the model (model(inputs)), so the tables cannot be "
                        "pulled with it before the forward. Call the model itself in the loss "
                        "function for one request per ps task and step.")
            return False
        push = self._client.prepare_push(grads, lr)
        self._tables.carry(dict(enumerate(push.requests)),
                           lambda replies: self._adopt(lambda: self._client.finish_prepared(
                               push, replies, pull_into=self._into)))
        return True

    def send(self) -> bool:
        """Send the push no table pull has carried (its replies adopted); whether there was
        one."""
        carried = self._tables.take_carried()
        if carried is not None:
            carried[1]({})  # no replies: finish_prepared sends it
        return carried is not None

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        """A forward that did not pull its tables ahead gets fresh dense parameters first."""
        self.send()

    def close(self) -> None:
        """Take the pre-hook off the model (a push still carried is not sent: :meth:`send`
        it first)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
