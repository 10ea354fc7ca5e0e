"""Criteo's display-advertising TSV: 40 fields, gzipped or not, hashed ids, bad lines refused."""

from __future__ import annotations

import gzip
import math
import random

import pytest
import torch
from recsys_files import criteo_line, write_criteo

from towerflow.data.criteo import find_criteo, load_criteo, read_criteo
from towerflow.errors import DataLossError, NotFoundError


def test_a_line_reads_as_label_dense_and_hashed_ids(tmp_path) -> None:
    ints = ["5", "", "-1", *["0"] * 9, "1000"]
    cats = ["68fd1e64", "", "FFFFFFFF", *["00000001"] * 23]
    (tmp_path / "train.txt").write_text("\t".join(["1", *ints, *cats]) + "\n")
    data = read_criteo(tmp_path / "train.txt", buckets=1000)
    assert data.names == tuple(f"C{j}" for j in range(1, 27))
    assert data.rows == (1001,) * 26
    assert data.labels.tolist() == [1.0] and data.labels.dtype == torch.float32
    assert data.dense.shape == (1, 13)
    assert data.dense[0, 0].item() == pytest.approx(math.log(6))
    assert data.dense[0, 1:3].tolist() == [0.0, 0.0]  # empty, negative: 0
    assert data.dense[0, 12].item() == pytest.approx(math.log(1001))
    ids = [int(f[0]) for f in data.fields]
    assert ids[:3] == [1 + 0x68FD1E64 % 1000, 0, 1 + 0xFFFFFFFF % 1000]
    assert all(f.dtype == torch.int64 for f in data.fields)


def test_the_gzipped_file_reads_as_its_plain_twin(tmp_path) -> None:
    plain = write_criteo(tmp_path / "plain", 300, seed=3)
    zipped = write_criteo(tmp_path / "gz", 300, gz=True, seed=3)
    assert gzip.decompress(zipped.read_bytes()) == plain.read_bytes()
    a = read_criteo(plain, buckets=50, chunk_rows=64)
    b = read_criteo(zipped, buckets=50, chunk_rows=128)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.dense, b.dense)
    assert all(torch.equal(x, y) for x, y in zip(a.fields, b.fields, strict=True))
    assert all(int(f.max()) <= 50 for f in a.fields)


def test_the_test_split_is_the_last_lines(tmp_path) -> None:
    write_criteo(tmp_path / "dac", 100, gz=True)
    whole = read_criteo(find_criteo(tmp_path), buckets=10)
    train = load_criteo(tmp_path, "train", buckets=10, test_fraction=0.1)
    test = load_criteo(tmp_path, "test", buckets=10, test_fraction=0.1)
    assert (len(train), len(test)) == (90, 10)
    assert torch.equal(test.dense, whole.dense[90:]) and torch.equal(train.labels,
                                                                    whole.labels[:90])


@pytest.mark.parametrize(("change", "pattern"), [
    (lambda f: f[:-1], r"line 4: 39 fields instead of 40"),
    (lambda f: [*f, "x"], r"line 4: 41 fields instead of 40"),
    (lambda f: ["2", *f[1:]], r"line 4: label '2' is not 0 or 1"),
    (lambda f: [f[0], "1.5", *f[2:]], r"line 4: I1 '1.5' is not an integer"),
    (lambda f: [*f[:16], "abc", *f[17:]], r"line 4: C3 'abc' is not eight hex digits"),
])
def test_a_bad_line_is_refused_with_its_number(tmp_path, change, pattern) -> None:
    r = random.Random(0)
    lines = [criteo_line(r) for _ in range(6)]
    lines[3] = "\t".join(change(lines[3].split("\t")))
    path = tmp_path / "train.txt.gz"
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    with pytest.raises(DataLossError, match=r"train\.txt\.gz, " + pattern):
        read_criteo(path, chunk_rows=2)  # line numbers count across chunks


def test_a_blank_line_is_refused(tmp_path) -> None:
    r = random.Random(1)
    (tmp_path / "train.txt").write_text(criteo_line(r) + "\n\n" + criteo_line(r) + "\n")
    with pytest.raises(DataLossError, match=r"line 2: 1 fields instead of 40"):
        read_criteo(tmp_path / "train.txt")


def test_no_file_names_where_to_put_it(tmp_path) -> None:
    with pytest.raises(NotFoundError, match=r"No Criteo logs \(train\.txt or train\.txt\.gz\)"):
        find_criteo(tmp_path)
