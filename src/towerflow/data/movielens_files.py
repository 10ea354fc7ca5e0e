"""The MovieLens files, one reader each: rows as strings, checked, refused with their line.

:func:`read_table` reads a delimited file with pandas in chunks (every value
a string, ``""`` for an empty one); :func:`numbers` turns a column into
numbers and refuses the first that is not one, naming the file and line;
:func:`read_users` and :func:`read_genres` build the users' attributes and
the movies' genres as arrays indexed by id (``-1`` where the file has no
such id). :mod:`towerflow.data.movielens` puts them together.

Example:
    >>> GENRES[:3]
    ('unknown', 'Action', 'Adventure')
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from towerflow.data.recsys import bad_row
from towerflow.errors import DataLossError

__all__ = ["AGE_EDGES", "FIX", "GENRES", "OCCUPATIONS_100K", "ids_in_range", "numbers",
           "read_genres", "read_ratings", "read_table", "read_users"]

#: every genre any variant names (ml-100k's 19, ml-20m's "Children", "IMAX", "(no genres listed)")
GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
          "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
          "Romance", "Sci-Fi", "Thriller", "War", "Western", "Children", "IMAX",
          "(no genres listed)")
#: ml-100k's u.occupation, in its order
OCCUPATIONS_100K = ("administrator", "artist", "doctor", "educator", "engineer", "entertainment",
                    "executive", "healthcare", "homemaker", "lawyer", "librarian", "marketing",
                    "none", "other", "programmer", "retired", "salesman", "scientist",
                    "student", "technician", "writer")
AGE_EDGES = (18, 25, 35, 45, 50, 56)  # ml-1m's age groups' lower bounds after "under 18"
FIX = "put the publisher's files there unchanged (or delete them to download them again)"
_CHUNK_ROWS = 1_000_000


def read_table(path: Path, names: Sequence[str], *, sep: str, header: bool,
               encoding: str = "latin-1") -> pd.DataFrame:
    """All rows of a delimited file as strings (``""`` for an empty field), read in chunks."""
    engine = "python" if len(sep) > 1 else "c"
    try:
        chunks = pd.read_csv(path, sep=sep, header=0 if header else None, names=list(names),
                             dtype=str, keep_default_na=False, skip_blank_lines=False,
                             encoding=encoding, engine=engine, chunksize=_CHUNK_ROWS)
        frame = pd.concat(list(chunks), ignore_index=True)
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
        raise DataLossError(f"{path}: {exc}; {FIX}.") from exc
    if header:
        _check_header(path, sep, encoding, names)
    return frame


def _check_header(path: Path, sep: str, encoding: str, names: Sequence[str]) -> None:
    with open(path, encoding=encoding) as f:
        first = f.readline().rstrip("\r\n").split(sep)
    if first != list(names):
        raise bad_row(path, 1, f"the header is {sep.join(first)!r}, not {sep.join(names)!r}",
                      FIX)


def numbers(frame: pd.DataFrame, column: str, path: Path, header: bool, *,
             integer: bool = True) -> np.ndarray:
    """A column as numbers; the first empty or non-numeric value is refused with its line."""
    values = pd.to_numeric(frame[column].replace("", None), errors="coerce")
    bad = values.isna().to_numpy()
    if integer:
        bad = bad | (values.fillna(0) % 1 != 0).to_numpy()
    if bad.any():
        row = int(np.argmax(bad))
        raise bad_row(path, row + 1 + int(header),
                      f"{column} {frame[column].iloc[row]!r} is not "
                      f"{'an integer' if integer else 'a number'}", FIX)
    return values.to_numpy(dtype=np.int64 if integer else np.float64, copy=True)


def ids_in_range(ids: np.ndarray, top: int, path: Path, header: bool, what: str,
                  variant: str) -> None:
    bad = (ids < 1) | (ids > top)
    if bad.any():
        row = int(np.argmax(bad))
        raise bad_row(path, row + 1 + int(header),
                      f"{what} {ids[row]} is outside {variant}'s published 1..{top}",
                      f"read it as the variant it is (--movielens-variant), or {FIX}")




def read_ratings(path: Path, variant: str) -> tuple[np.ndarray, ...]:
    """Users, movies, ratings and timestamps of a ratings file, as numbers.

    Read as numbers straight away (ml-20m's 20M lines as strings would take
    gigabytes); when that fails, the file is read again as strings to name
    the first bad line.
    """
    csv = variant in ("ml-20m", "ml-25m")
    names = ("userId", "movieId", "rating", "timestamp") if csv else (
        "user", "item", "rating", "timestamp")
    sep = "," if csv else "\t" if variant == "ml-100k" else "::"
    kinds = dict(zip(names, ("int64", "int64", "float64", "int64"), strict=True))
    try:
        chunks = pd.read_csv(path, sep=sep, header=0 if csv else None, names=list(names),
                             dtype=kinds, encoding="utf-8" if csv else "latin-1",
                             engine="python" if len(sep) > 1 else "c", chunksize=_CHUNK_ROWS)
        frame = pd.concat(list(chunks), ignore_index=True)
        if frame["rating"].isna().any():
            raise ValueError("an empty rating")
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError):
        frame = read_table(path, names, sep=sep, header=csv,
                           encoding="utf-8" if csv else "latin-1")
        columns = [numbers(frame, n, path, csv, integer=n != "rating") for n in names]
        return tuple(columns)
    if csv:
        _check_header(path, sep, "utf-8", names)
    return tuple(frame[n].to_numpy(copy=True) for n in names)


def _by_id(ids: np.ndarray, values: np.ndarray, top: int) -> np.ndarray:
    """``values`` (one row per id) laid out by id, ``-1`` for ids the file lacks."""
    table = np.full((top + 1, *values.shape[1:]), -1, dtype=np.int64)
    table[ids] = values
    return table


def _codes(column: pd.Series, known: dict[str, int], path: Path, what: str) -> np.ndarray:
    """The ids of a column's names; the first unknown name is refused with its line."""
    codes = column.map(known)
    bad = codes.isna().to_numpy()
    if bad.any():
        row = int(np.argmax(bad))
        raise bad_row(path, row + 1, f"{what} {column.iloc[row]!r} is not one of "
                      f"{', '.join(known)}", FIX)
    return codes.to_numpy(dtype=np.int64)


def read_users(path: Path, variant: str, top: int) -> dict[str, np.ndarray]:
    """Age group, gender, occupation and zip prefix ids of ml-100k's ``u.user`` or
    ml-1m's ``users.dat``, each an array indexed by user id (``-1``: no such user)."""
    if variant == "ml-100k":
        frame = read_table(path, ("user", "age", "gender", "occupation", "zip"), sep="|",
                           header=False)
        ages = numbers(frame, "age", path, False)
        age = 1 + np.searchsorted(np.asarray(AGE_EDGES), ages, side="right")
        occupation = _codes(frame["occupation"],
                            {name: i + 1 for i, name in enumerate(OCCUPATIONS_100K)},
                            path, "occupation")
    else:
        frame = read_table(path, ("user", "gender", "age", "occupation", "zip"), sep="::",
                           header=False)
        age = _codes(frame["age"], {str(a): i + 1 for i, a in enumerate((1, *AGE_EDGES))},
                     path, "age group")
        occupation = _codes(frame["occupation"], {str(c): c + 1 for c in range(21)}, path,
                            "occupation")
    users = numbers(frame, "user", path, False)
    ids_in_range(users, top, path, False, "user", variant)
    gender = _codes(frame["gender"], {"M": 1, "F": 2}, path, "gender")
    prefix = frame["zip"].str.slice(0, 3)
    digits = prefix.str.fullmatch(r"\d{3}").to_numpy(dtype=bool)
    zips = np.where(digits, 1 + pd.to_numeric(prefix.where(digits, "0")).to_numpy(), 0)
    return {name: _by_id(users, values.astype(np.int64), top) for name, values in
            (("age", age), ("gender", gender), ("occupation", occupation), ("zip", zips))}


def read_genres(path: Path, variant: str, top: int, genres: Sequence[str]) -> np.ndarray:
    """Each movie's genre ids (1 + position in ``genres``), padded with 0, indexed by movie
    id: ml-100k's ``u.item`` flags, ml-1m's ``movies.dat`` or ml-20m/25m's ``movies.csv``."""
    csv = path.suffix == ".csv"
    if variant == "ml-100k":
        flags = [f"flag{i}" for i in range(19)]
        frame = read_table(path, ("item", "title", "released", "video", "url", *flags),
                           sep="|", header=False)
        bits = np.stack([numbers(frame, f, path, False) for f in flags], axis=1)
        if ((bits != 0) & (bits != 1)).any():
            row = int(np.argmax(((bits != 0) & (bits != 1)).any(axis=1)))
            raise bad_row(path, row + 1, "a genre flag is not 0 or 1", FIX)
        lists = [[genres[j] for j in np.flatnonzero(b)] for b in bits]
    else:
        frame = (read_table(path, ("movieId", "title", "genres"), sep=",", header=True,
                            encoding="utf-8") if csv else
                 read_table(path, ("item", "title", "genres"), sep="::", header=False))
        lists = [text.split("|") for text in frame["genres"]]
    known = {name: i + 1 for i, name in enumerate(genres)}
    width = max(1, max((len(g) for g in lists), default=1))
    ids = np.zeros((len(lists), width), dtype=np.int64)
    for row, names in enumerate(lists):
        for col, name in enumerate(names):
            if name not in known:
                raise bad_row(path, row + 1 + int(csv), f"genre {name!r} is not one of "
                              f"{', '.join(genres)}", FIX)
            ids[row, col] = known[name]
    items = numbers(frame, frame.columns[0], path, csv)
    ids_in_range(items, top, path, csv, "movie", variant)
    return _by_id(items, ids, top)
