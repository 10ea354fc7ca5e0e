"""The ``Trainer`` reads one batch ahead for a strategy that pulls the next step's rows while
a step runs (``Strategy.reads_ahead``): its position stays the one after the batch trained."""

from __future__ import annotations

import torch

from towerflow.training.pipeline import IterablePipeline, ReadAhead


class Counted:
    """A resumable iterable of batches 0, 1, 2, ... (``state`` / ``load_state``)."""

    def __init__(self) -> None:
        self.next = 0

    def __iter__(self):  # noqa: ANN204
        while True:
            batch = torch.full((self.next % 3 + 1, 2), float(self.next))
            self.next += 1
            yield batch

    def state(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state(self, state: dict[str, int]) -> None:
        self.next = state["next"]


def test_a_batch_read_ahead_is_the_next_one_returned_and_not_counted_in_the_position() -> None:
    pipeline = ReadAhead(IterablePipeline(Counted(), device=torch.device("cpu")))
    first = next(pipeline)
    assert first[0, 0] == 0 and pipeline.position() == {"next": 1}
    peeked = pipeline.peek()
    assert peeked[0, 0] == 1 and pipeline.peek() is peeked  # read once
    assert pipeline.position() == {"next": 1} and pipeline.examples_per_batch() == 1
    assert next(pipeline) is peeked
    assert pipeline.position() == {"next": 2} and pipeline.examples_per_batch() == 2
    pipeline.peek()
    # a run resumed from this position trains the batch that was read ahead, not the one after
    resumed = IterablePipeline(Counted(), device=torch.device("cpu"),
                               position=pipeline.position())
    assert next(resumed)[0, 0] == 2
    assert next(pipeline)[0, 0] == 2
