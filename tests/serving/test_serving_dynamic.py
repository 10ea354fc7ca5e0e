"""Dynamic tables in exports: any int64 id, unknown ids answered by the default, eviction
carried by deltas; the serving description refused when malformed; ``towerflow export``.

Exports here are written by the exporter's own functions from hand-made sources (a
dynamic table's parts as a training checkpoint will hold them: ids in any order).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from towerflow import serving
from towerflow.checkpoint.format import write_checkpoint_dir
from towerflow.cli import main
from towerflow.errors import CheckpointError, InvalidArgumentError
from towerflow.serving.chain import read_export, table_state
from towerflow.serving.exporting import Source
from towerflow.serving.layout import check_description, describe, table_entry, write_export
from towerflow.serving.lookup import DynamicLookup

DIM = 3
BIG = 1 << 40


class Table(nn.Module):
    """A stand-in for a table of the ps tasks as a model declares it: rows held elsewhere."""

    def __init__(self, dim: int, mode: str | None = None) -> None:
        super().__init__()
        self.num_rows, self.dim, self.mode, self.table_name = None, dim, mode, None


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ids = Table(DIM)
        self.bag = Table(DIM, mode="sum")
        self.out = nn.Linear(2 * DIM, 1)

    def forward(self, ids: torch.Tensor, bag: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.ids(ids), self.bag(bag)], 1)).squeeze(1)


def rows_of(keys: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return ((keys.remainder(997)[:, None] + torch.arange(DIM)) * scale).float()


def source(step: int, tables: dict[str, torch.Tensor], scale: float = 1.0,
           default: list[float] | None = None) -> Source:
    """A trainer's state: each table's ids split over two shards, in no order."""
    descriptions = {name: {"kind": "dynamic", "dim": DIM, "dtype": "float32",
                           "partitioner": {"kind": "hash", "num_shards": 2},
                           "default": default if name == "ids" else None}
                    for name in tables}
    parts = []
    for name, keys in tables.items():
        shuffled = keys[torch.randperm(keys.numel(), generator=torch.Generator().manual_seed(1))]
        for shard in range(2):
            mine = shuffled[shuffled.remainder(2) == shard]
            parts.append(({"table": name, "shard": shard},
                          {"ids": mine, "rows": rows_of(mine, scale)}))
    dense = {"out.weight": torch.full((1, 2 * DIM), 0.5), "out.bias": torch.zeros(1)}
    return Source(step, dense, descriptions, parts)


KEYS = torch.tensor([5, -7, BIG, 3, 2**62, 11])


def test_a_dynamic_table_looks_up_any_id_and_answers_unknown_ones_with_its_default(
        tmp_path) -> None:
    out = serving.export_source(source(4, {"ids": KEYS, "bag": KEYS}, default=[9.0, 9.0, 9.0]),
                                tmp_path / "full")
    model = serving.load(out, Model())
    assert isinstance(model.ids, DynamicLookup) and model.ids.num_keys == 6
    ids = torch.tensor([[BIG], [4], [-7]]).reshape(-1)
    got = model.ids(ids)
    assert torch.equal(got[0], rows_of(torch.tensor([BIG]))[0])
    assert got[1].tolist() == [9.0, 9.0, 9.0]  # unknown: the declared default
    assert torch.equal(got[2], rows_of(torch.tensor([-7]))[0])
    bag = model.bag(torch.tensor([[3, 12345]]))  # unknown in a bag: zeros (no default)
    assert torch.equal(bag[0], rows_of(torch.tensor([3]))[0])
    batch = torch.export.Dim("batch", min=2, max=1024)
    program = torch.export.export(model, (torch.tensor([5, 6, BIG]), torch.tensor(
        [[5, 6], [BIG, -7], [1, 2]])), dynamic_shapes=({0: batch}, {0: batch}))
    x = (torch.tensor([11, 0, 2**62, -7, 5]), torch.tensor([[11, 3]] * 5))
    assert torch.equal(program.module()(*x), model(*x))


def test_a_delta_of_a_run_with_eviction_removes_the_evicted_ids(tmp_path) -> None:
    full = serving.export_source(source(4, {"ids": KEYS, "bag": KEYS}), tmp_path / "full")
    later = torch.tensor([5, BIG, 3, 2**62, 11, 99])  # -7 evicted, 99 new
    scaled = source(8, {"ids": later, "bag": KEYS})
    delta = serving.export_source(scaled, tmp_path / "delta", since=full)
    described = read_export(delta).description["tables"]
    assert (described["ids"]["rows"], described["ids"]["removed"]) == (1, 1)  # only 99 is new
    assert (described["bag"]["rows"], described["bag"]["removed"]) == (0, 0)
    model = serving.load(delta, Model())
    assert model.ids.keys.tolist() == sorted(later.tolist())
    assert model.ids(torch.tensor([-7])).tolist() == [[0.0, 0.0, 0.0]]
    changed = source(9, {"ids": later, "bag": KEYS}, scale=2.0)
    again = serving.export_source(changed, tmp_path / "delta2", since=delta)
    assert read_export(again).description["tables"]["ids"]["rows"] == later.numel()
    direct = serving.load(serving.export_source(source(9, {"ids": later, "bag": KEYS},
                                                       scale=2.0), tmp_path / "f9"), Model())
    chained = serving.load([full, delta, again], Model())
    for key, value in direct.state_dict().items():
        assert torch.equal(chained.state_dict()[key], value), key


def _states() -> st.SearchStrategy:
    """3-4 successive states of a dynamic table: id -> a row's value (ids added, evicted,
    changed between states)."""
    ids = st.integers(-(2**62), 2**62)
    state = st.dictionaries(ids, st.integers(-3, 3), max_size=12)
    return st.lists(state, min_size=3, max_size=4)


@settings(max_examples=12, deadline=None)
@given(states=_states())
def test_any_chain_of_deltas_loads_bit_exact_to_a_full_export_of_its_last_state(states) -> None:
    import tempfile

    def state_source(step: int, state: dict[int, int]) -> Source:
        keys = torch.tensor(sorted(state), dtype=torch.int64)
        rows = torch.tensor([[float(state[k])] * DIM for k in sorted(state)]).reshape(-1, DIM)
        part = ({"table": "ids", "shard": 0}, {"ids": keys.flip(0), "rows": rows.flip(0)})
        tables = {"ids": {"kind": "dynamic", "dim": DIM, "dtype": "float32"}}
        return Source(step, {}, tables, [part])

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        chain = [serving.export_source(state_source(0, states[0]), root / "s0")]
        for step, state in enumerate(states[1:], start=1):
            chain.append(serving.export_source(state_source(step, state), root / f"s{step}",
                                               since=chain[-1]))
        last = serving.export_source(state_source(9, states[-1]), root / "full")
        got = table_state(serving.resolve_chain(chain), "ids")
        want = table_state(serving.resolve_chain(last), "ids")
    assert torch.equal(got.keys, want.keys) and torch.equal(got.rows, want.rows)
    assert got.keys.tolist() == sorted(states[-1])


def test_a_delta_whose_tables_differ_from_its_base_is_refused(tmp_path) -> None:
    full = serving.export_source(source(4, {"ids": KEYS, "bag": KEYS}), tmp_path / "full")
    with pytest.raises(InvalidArgumentError, match="table 'bag' is gone.*Write a full export"):
        serving.export_source(source(5, {"ids": KEYS}), tmp_path / "d", since=full)
    with pytest.raises(InvalidArgumentError, match="step 3, before the base's 4"):
        serving.export_source(source(3, {"ids": KEYS, "bag": KEYS}), tmp_path / "d", since=full)
    assert not (tmp_path / "d").exists()


def test_a_part_holding_an_id_twice_publishes_nothing(tmp_path) -> None:
    description = describe("full", 1, {"t": table_entry("dynamic", None, 2, "float32")})
    parts = [({"table": "t"}, {"keys": torch.tensor([4, 1, 4]), "rows": torch.zeros(3, 2)})]
    with pytest.raises(InvalidArgumentError, match="'t': a part holds an id twice"):
        write_export(tmp_path / "e", description, {}, parts)
    assert list(tmp_path.iterdir()) == []


def test_lookup_modules_refuse_unsorted_keys_and_bad_defaults() -> None:
    with pytest.raises(InvalidArgumentError, match="not strictly increasing"):
        DynamicLookup(torch.tensor([3, 1]), torch.zeros(2, 2))
    with pytest.raises(InvalidArgumentError, match=r"default of shape \(3,\); give \(2,\)"):
        DynamicLookup(torch.tensor([1]), torch.zeros(1, 2), default=torch.zeros(3))
    empty = DynamicLookup(torch.empty(0, dtype=torch.int64), torch.empty(0, 2))
    assert empty(torch.tensor([0, 5])).tolist() == [[0.0, 0.0], [0.0, 0.0]]


# --------------------------------------------------------------------------- the description
def _tables() -> st.SearchStrategy:
    fixed = st.builds(lambda n, d: table_entry("fixed", n, d, "float32"),
                      st.integers(1, 10**9), st.integers(1, 4096))
    dynamic = st.builds(lambda d, f: table_entry("dynamic", None, d, "float64",
                                                 default=[f] * d if f is not None else None),
                        st.integers(1, 8), st.none() | st.floats(-1e6, 1e6))
    return st.dictionaries(st.text(min_size=1, max_size=20), fixed | dynamic, max_size=4)


@settings(max_examples=60, deadline=None)
@given(tables=_tables(), step=st.integers(0, 2**40), delta=st.booleans())
def test_a_description_round_trips_through_json_and_is_checked_on_read(tables, step,
                                                                       delta) -> None:
    base = {"name": "full-00000001", "step": 0, "manifest_sha256": "a" * 64} if delta else None
    description = describe("delta" if delta else "full", step, tables, base=base)
    manifest = {"step": step, "metadata": {"serving": json.loads(json.dumps(description))}}
    assert check_description(Path("e"), manifest) == description


_BREAKS = [
    ("format", "towerflow.serving/0", "not of format"),
    ("kind", "partial", "kind 'partial'"),
    ("step", -1, "step is not"),
    ("base", {"name": "../etc", "step": 0, "manifest_sha256": "a" * 64}, "a full export names"),
    ("tables", {"t": {**table_entry("fixed", 0, 2, "float32")}}, "num_rows 0"),
    ("tables", {"t": {**table_entry("dynamic", None, 2, "int8")}}, "dtype 'int8'"),
    ("tables", {"t": {**table_entry("dynamic", None, 2, "float32", default=[1.0])}},
     "default that is not a list of 2"),
]


@pytest.mark.parametrize("key, value, message", _BREAKS)
def test_a_malformed_description_is_refused_naming_the_manifest(key, value, message) -> None:
    description = {**describe("full", 3, {}), key: value}
    manifest = {"step": 3, "metadata": {"serving": description}}
    with pytest.raises(CheckpointError, match=f"manifest.json.*{message}.*export it again"):
        check_description(Path("e"), manifest)


@settings(max_examples=30, deadline=None)
@given(name=st.text(max_size=30))
def test_a_deltas_base_must_be_a_plain_name_in_its_directory(name) -> None:
    base = {"name": name, "step": 0, "manifest_sha256": "b" * 64}
    plain = bool(name) and name[0] not in ".-" and all(
        c.isascii() and (c.isalnum() or c in "_.-") for c in name)
    if plain:
        assert describe("delta", 1, {}, base=base)["base"]["name"] == name
    else:
        with pytest.raises(InvalidArgumentError, match="not a plain directory name"):
            describe("delta", 1, {}, base=base)


# --------------------------------------------------------------------------- the command
def _checkpoint(path: Path, step: int, scale: float, shards: int = 2) -> Path:
    """A training checkpoint with one fixed table of 6 x 2 in two shards' parts."""
    from towerflow.checkpoint import ChunkedGroup

    ids = [torch.tensor([0, 2, 4]), torch.tensor([1, 3, 5])][:shards]
    parts = ChunkedGroup(({"table": "emb", "shard": s, "part": 0},
                          {"ids": i, "rows": i.float()[:, None].repeat(1, 2) * scale,
                           "slot.accumulator": torch.ones(3, 2)}) for s, i in enumerate(ids))
    tables = {"emb": {"num_rows": 6, "dim": 2, "dtype": "float32",
                      "partitioner": {"kind": "mod", "num_shards": 2, "num_rows": 6}}}
    return write_checkpoint_dir(path, step, {"model": {"out.weight": torch.ones(1, 2)},
                                             "ps_tables": parts},
                                {"step": step, "strategy": {"tables": tables}})


def test_a_checkpoint_that_does_not_cover_a_fixed_table_writes_no_export(tmp_path) -> None:
    from towerflow.errors import DataLossError

    ckpt = _checkpoint(tmp_path / "ckpt-00000002", 2, 1.0, shards=1)
    with pytest.raises(DataLossError, match=r"'emb' \(3 of 6 rows\); no export was written"):
        serving.export(ckpt, tmp_path / "e")
    assert not (tmp_path / "e").exists() and not [
        p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_towerflow_export_writes_a_full_export_and_a_delta(tmp_path, capsys) -> None:
    first = _checkpoint(tmp_path / "ckpt-00000002", 2, 1.0)
    assert main(["export", "--train-dir", str(first), "--out", str(tmp_path / "e1")]) == 0
    line = capsys.readouterr().out
    assert line.startswith("exported step 2 (full: 6 rows of 1 table(s)) to ")
    second = _checkpoint(tmp_path / "ckpt-00000005", 5, 1.0)
    assert read_export(tmp_path / "e1").step == 2
    assert main(["export", "--train-dir", str(second), "--out", str(tmp_path / "e2"),
                 "--since", str(tmp_path / "e1")]) == 0
    assert "(delta: 0 rows of 1 table(s))" in capsys.readouterr().out
    assert main(["export", "--train-dir", str(second), "--out", str(tmp_path / "e2")]) == 2
    assert "exists; an export is never written over another" in capsys.readouterr().err
