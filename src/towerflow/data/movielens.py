"""MovieLens as GroupLens publishes it, as a click-through task: did the user rate the movie 4+?

Files, found in ``data_dir/<variant>/`` (the archive's own folder) or in
``data_dir`` itself:

=========  ==========================================================================
variant    files (as published)
=========  ==========================================================================
ml-100k    ``u.data`` (tab: user item rating timestamp), ``u.user``
           (``|``: user|age|gender|occupation|zip), ``u.item`` (``|``, latin-1:
           movie id|title|release date|video release date|IMDb URL|19 genre flags)
ml-1m      ``ratings.dat`` (UserID::MovieID::Rating::Timestamp), ``users.dat``
           (UserID::Gender::Age::Occupation::Zip-code), ``movies.dat``
           (MovieID::Title::Genres, genres ``|``-joined); ``::``, latin-1
ml-20m,    ``ratings.csv`` (header userId,movieId,rating,timestamp), ``movies.csv``
ml-25m     (header movieId,title,genres; quoted titles); UTF-8
=========  ==========================================================================

Every rating is one example: label 1 when the rating is 4 or more. The
split is by time: the last ``test_fraction`` of the ratings by timestamp
(ties in file order) is the test split, the rest the training split.

Fields (int64 ids, the same ids on every read, so no vocabulary is stored):

- ``user``, ``item``: the publisher's ids as they are; the table has the
  variant's published largest id + 1 rows (an id above it is refused).
- ``age``: ml-1m's seven age groups (under 18, 18-24, 25-34, 35-44, 45-49,
  50-55, 56+) as ids 1..7; ml-100k's ages are put in the same groups.
- ``gender``: M 1, F 2. ``occupation``: 1 + ml-1m's code (0..20), or 1 +
  the position of ml-100k's name in its ``u.occupation`` list (21 names).
- ``zip``: the first three characters of the zip code, 1 + their value when
  they are digits (a US sectional centre), 0 when not (a code from outside
  the US, such as ``T8H1N``).
- ``genres``: the movie's genres, one id each (1 + the position in
  :data:`GENRES`), padded with 0 to the most genres of any movie: a field of
  several ids.

ml-20m and ml-25m publish no user attributes: their fields are ``user``,
``item`` and ``genres``.

Example:
    >>> sorted(VARIANTS)
    ['ml-100k', 'ml-1m', 'ml-20m', 'ml-25m']
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from towerflow.data.movielens_files import (
    AGE_EDGES,
    FIX,
    GENRES,
    OCCUPATIONS_100K,
    ids_in_range,
    read_genres,
    read_ratings,
    read_users,
)
from towerflow.data.recsys import FieldData, bad_row, download_zip, time_split
from towerflow.errors import InvalidArgumentError, NotFoundError

__all__ = ["GENRES", "MOVIELENS_URLS", "VARIANTS", "load_movielens", "movielens_rows",
           "find_movielens"]

logger = logging.getLogger(__name__)

_BASE = "https://files.grouplens.org/datasets/movielens/"


@dataclass(frozen=True, slots=True)
class _Variant:
    ratings: str
    users: str | None
    movies: str
    max_user: int
    max_item: int
    md5: str


#: the variants, their files and the publisher's largest user and movie ids and archive MD5
VARIANTS = {
    "ml-100k": _Variant("u.data", "u.user", "u.item", 943, 1682,
                        "0e33842e24a9c977be4e0107933c0723"),
    "ml-1m": _Variant("ratings.dat", "users.dat", "movies.dat", 6040, 3952,
                      "c4d9eecfca2ab87c1945afe126590906"),
    "ml-20m": _Variant("ratings.csv", None, "movies.csv", 138493, 131262,
                       "cd245b17a1ae2cc31bb14903e1204af3"),
    "ml-25m": _Variant("ratings.csv", None, "movies.csv", 162541, 209171,
                       "6b51fb2759a8657d3bfcbfc42b592ada"),
}
MOVIELENS_URLS = {name: f"{_BASE}{name}.zip" for name in VARIANTS}


def _variant(variant: str) -> _Variant:
    if variant not in VARIANTS:
        raise InvalidArgumentError(f"MovieLens variant {variant!r} is not one this reader "
                                   f"knows; use one of {', '.join(VARIANTS)}.")
    return VARIANTS[variant]


def movielens_rows(variant: str) -> dict[str, int]:
    """Each field's table rows for ``variant`` (fixed: no data needs to be read).

    Example:
        >>> movielens_rows("ml-100k")["item"]
        1683
    """
    spec = _variant(variant)
    rows = {"user": spec.max_user + 1, "item": spec.max_item + 1}
    if spec.users is not None:
        rows.update(age=len(AGE_EDGES) + 2, gender=3, occupation=len(OCCUPATIONS_100K) + 1,
                    zip=1001)
    rows["genres"] = len(GENRES) + 1
    return rows


def find_movielens(data_dir: str | Path, variant: str, *, download: bool = False) -> Path:
    """The folder holding ``variant``'s files: ``data_dir/<variant>`` or ``data_dir``.

    Raises:
        NotFoundError: the files are in neither and ``download`` is False.
        UnavailableError: the download failed.
    """
    spec = _variant(variant)
    data_dir = Path(data_dir)
    names = [n for n in (spec.ratings, spec.users, spec.movies) if n is not None]
    for base in (data_dir / variant, data_dir):
        if all((base / n).is_file() for n in names):
            return base
    if not download:
        raise NotFoundError(
            f"MovieLens {variant} files {', '.join(names)} are not in {str(data_dir)!r} nor "
            f"in its {variant} folder; leave out --no-download to fetch "
            f"{MOVIELENS_URLS[variant]}, or unzip that archive into {str(data_dir)!r}.")
    download_zip(MOVIELENS_URLS[variant], spec.md5, data_dir, what=f"MovieLens {variant}",
                 way_out=f"check the network, or download the archive elsewhere and unzip it "
                 f"into {str(data_dir)!r} (then --no-download reads only the files there).")
    return find_movielens(data_dir, variant)


def load_movielens(data_dir: str | Path, split: str = "train", *, variant: str = "ml-100k",
                   test_fraction: float = 0.2, download: bool = False) -> FieldData:
    """The ``train`` or ``test`` split of a MovieLens variant as click-through examples.

    Args:
        data_dir: holds the variant's folder (``ml-100k/``) or its files.
        split: ``"train"`` (the earliest ratings) or ``"test"`` (the last
            ``test_fraction`` of them by time).
        variant: ``ml-100k``, ``ml-1m``, ``ml-20m`` or ``ml-25m``.
        test_fraction: the share of the ratings, the latest, in the test split.
        download: fetch the publisher's archive (and check its MD5) when the
            files are absent.

    Raises:
        NotFoundError: the files are absent and ``download`` is False.
        DataLossError: a bad row (the message names the file and line).
        UnavailableError: the download failed.
    """
    spec = _variant(variant)
    folder = find_movielens(data_dir, variant, download=download)
    csv = variant in ("ml-20m", "ml-25m")
    ratings_path = folder / spec.ratings
    users, items, stars, times = read_ratings(ratings_path, variant)
    ids_in_range(users, spec.max_user, ratings_path, csv, "user", variant)
    ids_in_range(items, spec.max_item, ratings_path, csv, "movie", variant)
    index = time_split(torch.from_numpy(times), split, test_fraction).numpy()
    fields = {"user": users[index], "item": items[index]}
    if spec.users is not None:
        table = read_users(folder / spec.users, variant, spec.max_user)
        fields.update(_lookup(table, users[index], ratings_path, "user", index))
    genres = read_genres(folder / spec.movies, variant, spec.max_item, GENRES)
    fields.update(_lookup({"genres": genres}, items[index], ratings_path, "movie", index))
    logger.debug("Read %d MovieLens %s %s ratings from %s", len(index), variant, split, folder)
    return FieldData(tuple(fields), tuple(torch.from_numpy(np.ascontiguousarray(v))
                                          for v in fields.values()),
                     movielens_rows(variant), torch.zeros(len(index), 0),
                     torch.from_numpy((stars[index] >= 4).astype(np.float32)))


def _lookup(table: dict[str, np.ndarray], keys: np.ndarray, path: Path, what: str,
            index: np.ndarray) -> dict[str, np.ndarray]:
    """Each attribute of ``table`` (rows by id; row 0 of an unknown id is -1) at ``keys``."""
    first = next(iter(table.values()))
    known = first[keys].reshape(len(keys), -1)[:, 0] >= 0
    if not known.all():
        row = int(np.argmax(~known))
        line = int(index[row]) + 1 + int(path.suffix == ".csv")
        raise bad_row(path, line, f"{what} {keys[row]} has no row in its {what}s' file",
                      f"add it there, or {FIX}")
    return {name: values[keys] for name, values in table.items()}
