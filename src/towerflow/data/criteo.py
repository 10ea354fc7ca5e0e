"""Criteo's display-advertising logs (the TSV of its Kaggle challenge), plain or gzipped.

Each line of ``train.txt`` (or ``train.txt.gz``) is one impression, 40
tab-separated fields: the label (1 clicked, 0 not), 13 integer features
``I1..I13`` and 26 categorical features ``C1..C26``, each eight hex digits
(a hashed value); any feature may be empty. The file is found in
``data_dir`` or its ``dac/`` folder (the challenge archive's name), read
with pandas in chunks of ``chunk_rows`` lines.

What the model gets:

- dense: ``log(1 + x)`` of each integer feature, a negative one (``I2``
  has some) counted as 0 first and an empty one as 0, float32 ``(N, 13)``;
- fields ``C1..C26``: each value's 32-bit number hashed into the field's
  ``buckets`` rows: id ``1 + value % buckets``, an empty value id 0, so a
  field's table has ``buckets + 1`` rows and no vocabulary is built or stored
  (two values may share a row; more buckets, fewer collisions);
- label: float32 0/1.

The file is in time order (seven days), so the split is by position: the
last ``test_fraction`` of the lines is the test split. A line of another
number of fields, a label other than 0/1, an integer feature that is not an
integer or a categorical one that is not eight hex digits is refused with
the file and line. There is no download: the logs come under Criteo's
terms from its site.

Example:
    >>> line = "\\t".join(["1", "5", "", *["0"] * 11, "68fd1e64", *[""] * 25])
    >>> len(line.split("\\t"))
    40
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from towerflow.data.recsys import FieldData, bad_row, time_split
from towerflow.errors import DataLossError, NotFoundError

__all__ = ["CRITEO_FILES", "NUM_CATEGORICAL", "NUM_INTEGER", "find_criteo", "load_criteo",
           "read_criteo"]

logger = logging.getLogger(__name__)

NUM_INTEGER, NUM_CATEGORICAL = 13, 26
#: the names looked for, in order, in ``data_dir`` and ``data_dir/dac``
CRITEO_FILES = ("train.txt", "train.txt.gz")
_FIELDS = 1 + NUM_INTEGER + NUM_CATEGORICAL
_FIX = "fix or remove that line (the logs have 40 tab-separated fields per line)"


def find_criteo(data_dir: str | Path) -> Path:
    """The Criteo file under ``data_dir``: ``train.txt`` or ``train.txt.gz``, or in ``dac/``.

    Raises:
        NotFoundError: none is there.
    """
    data_dir = Path(data_dir)
    for base in (data_dir, data_dir / "dac"):
        for name in CRITEO_FILES:
            if (base / name).is_file():
                return base / name
    raise NotFoundError(
        f"No Criteo logs ({' or '.join(CRITEO_FILES)}) in {str(data_dir)!r} nor in its dac "
        "folder; download the display-advertising challenge's logs from Criteo's site (their "
        "terms do not allow fetching them here) and put train.txt (or train.txt.gz) there.")


def _chunk(lines: pd.Series, path: Path, first_line: int, buckets: int) -> tuple[np.ndarray, ...]:
    """One chunk's labels, dense features and categorical ids; bad lines refused."""
    text = lines.fillna("")
    counts = text.str.count("\t").to_numpy()
    wrong = counts != _FIELDS - 1
    if wrong.any():
        row = int(np.argmax(wrong))
        raise bad_row(path, first_line + row, f"{counts[row] + 1} fields instead of {_FIELDS}",
                      _FIX)
    parts = text.str.split("\t", expand=True)
    label = parts[0]
    bad = ~label.isin(("0", "1")).to_numpy()
    if bad.any():
        row = int(np.argmax(bad))
        raise bad_row(path, first_line + row, f"label {label.iloc[row]!r} is not 0 or 1", _FIX)
    dense = np.zeros((len(parts), NUM_INTEGER), dtype=np.float32)
    for j in range(NUM_INTEGER):
        column = parts[1 + j]
        values = pd.to_numeric(column.replace("", "0"), errors="coerce")
        bad = (values.isna() | (values.fillna(0) % 1 != 0)).to_numpy()
        if bad.any():
            row = int(np.argmax(bad))
            raise bad_row(path, first_line + row, f"I{j + 1} {column.iloc[row]!r} is not an "
                          "integer", _FIX)
        dense[:, j] = np.log1p(np.maximum(values.to_numpy(dtype=np.float64), 0.0))
    ids = np.zeros((len(parts), NUM_CATEGORICAL), dtype=np.int64)
    for j in range(NUM_CATEGORICAL):
        column = parts[1 + NUM_INTEGER + j]
        bad = ~(column.str.fullmatch(r"[0-9a-fA-F]{8}") | (column == "")).to_numpy(dtype=bool)
        if bad.any():
            row = int(np.argmax(bad))
            raise bad_row(path, first_line + row, f"C{j + 1} {column.iloc[row]!r} is not eight "
                          "hex digits", _FIX)
        present = (column != "").to_numpy()
        raw = bytes.fromhex("".join(column[present].tolist()))  # 4 big-endian bytes each
        ids[present, j] = 1 + np.frombuffer(raw, dtype=">u4").astype(np.int64) % buckets
    return label.to_numpy(dtype=np.float32), dense, ids


def read_criteo(path: str | Path, *, buckets: int = 100_000,
                chunk_rows: int = 500_000) -> FieldData:
    """Every line of a Criteo TSV file (plain, or gzipped when its name ends in ``.gz``).

    Raises:
        DataLossError: a bad line (the message names the file and line).
    """
    path = Path(path)
    labels, dense, ids = [], [], []
    first_line = 1
    try:
        chunks = pd.read_csv(path, sep="\x1f", header=None, names=["line"], dtype=str,
                             keep_default_na=False, skip_blank_lines=False,
                             quoting=csv.QUOTE_NONE, compression="infer", chunksize=chunk_rows)
        for frame in chunks:
            parts = _chunk(frame["line"], path, first_line, buckets)
            for out, part in zip((labels, dense, ids), parts, strict=True):
                out.append(part)
            first_line += len(frame)
    except (pd.errors.ParserError, UnicodeDecodeError, OSError, EOFError) as exc:
        raise DataLossError(f"{path} cannot be read ({exc}); {_FIX}, or fetch the file "
                            "again.") from exc
    if not labels:
        raise DataLossError(f"{path} holds no line; put the Criteo logs there.")
    categorical = torch.from_numpy(np.concatenate(ids))
    names = tuple(f"C{j + 1}" for j in range(NUM_CATEGORICAL))
    return FieldData(names, tuple(categorical[:, j].contiguous() for j in range(len(names))),
                     dict.fromkeys(names, buckets + 1),
                     torch.from_numpy(np.concatenate(dense)),
                     torch.from_numpy(np.concatenate(labels)))


def load_criteo(data_dir: str | Path, split: str = "train", *, buckets: int = 100_000,
                test_fraction: float = 0.1, chunk_rows: int = 500_000) -> FieldData:
    """The ``train`` or ``test`` split (the last ``test_fraction`` of the lines) of the logs.

    Raises:
        NotFoundError: no Criteo file under ``data_dir``.
        DataLossError: a bad line.
    """
    path = find_criteo(data_dir)
    data = read_criteo(path, buckets=buckets, chunk_rows=chunk_rows)
    index = time_split(torch.arange(len(data)), split, test_fraction)
    logger.debug("Read %d Criteo %s examples from %s", len(index), split, path)
    return data.take(index)
