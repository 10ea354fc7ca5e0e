"""A MovieLens-100k-shaped data set with a planted truth, in GroupLens' exact ml-100k format.

:func:`write_movielens` writes ``u.data`` (tab: user item rating timestamp), ``u.user``
(``|``: user|age|gender|occupation|zip) and ``u.item`` (``|``, latin-1: movie id|title|
release date|video release date|IMDb URL|19 genre flags) for ``towerflow train movielens
--data-dir``: by default 943 users, 1,682 movies and 100,000 distinct (user, movie)
ratings, as the published set has, every user with at least 20 ratings, active users and
popular movies rated most, about 57% of the ratings 4 or 5 (ml-100k: 55%), timestamps
drawn over ml-100k's span with the lines in no order (the test split, the latest 20% by
time, is a random fifth).

The truth: a rating is 4+ with probability ``sigmoid(0.2 + user bias + movie bias +
<user factors, movie factors> (4 each) + the movie's genres x the user's gender + its
genres x the user's age group)``, every parameter drawn from a generator seeded by
``seed``; then 4 or 5 when liked, else 1, 2 or 3. Every term is something the DeepFM of
``towerflow train movielens`` can represent (a field's weight, the FM's user x movie
interaction, genre x gender and genre x age interactions), so the AUC it reaches
measures how well it trained; :func:`write_movielens` returns the truth's own AUC on the
test split, the best any model can score there.

Used by ``benchmarks/hybrid_modes.py``; alone (from ``benchmarks/``)::

    python -c "from pathlib import Path; from movielens_synthetic import write_movielens; \\
        print(write_movielens(Path('/tmp/ml/ml-100k')))"
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

OCCUPATIONS = ("administrator", "artist", "doctor", "educator", "engineer", "entertainment",
               "executive", "healthcare", "homemaker", "lawyer", "librarian", "marketing",
               "none", "other", "programmer", "retired", "salesman", "scientist",
               "student", "technician", "writer")
AGE_EDGES = (18, 25, 35, 45, 50, 56)
FIRST_TIME, LAST_TIME = 874_724_710, 893_286_638  # ml-100k's first and last timestamps


@dataclass(frozen=True, slots=True)
class Truth:
    """The planted truth's parameters (drawn once per seed)."""

    user_bias: np.ndarray
    item_bias: np.ndarray
    user_factors: np.ndarray
    item_factors: np.ndarray
    genres: np.ndarray  # items x 19 flags
    genre_gender: np.ndarray  # 19 x 2
    genre_age: np.ndarray  # 19 x 7


def _people(r: np.random.Generator, users: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Ages, genders (0 M, 1 F) and u.user lines."""
    ages = np.clip(r.normal(33, 12, users).round(), 7, 73).astype(int)
    female = r.random(users) < 0.29
    lines = []
    for u in range(users):
        zip_code = f"{r.integers(0, 100_000):05d}" if r.random() > 0.02 else "T8H1N"
        job = OCCUPATIONS[int(r.integers(len(OCCUPATIONS)))]
        lines.append(f"{u + 1}|{ages[u]}|{'F' if female[u] else 'M'}|{job}|{zip_code}\n")
    return ages, female.astype(int), lines


def _movies(r: np.random.Generator, items: int) -> tuple[np.ndarray, list[str]]:
    """Genre flags (items x 19) and u.item lines (latin-1 titles, GroupLens' columns)."""
    flags = np.zeros((items, 19), dtype=int)
    lines = []
    for i in range(items):
        chosen = r.choice(np.arange(1, 19), size=int(r.integers(1, 4)), replace=False)
        flags[i, chosen] = 1
        year = int(r.integers(1930, 1999))
        lines.append(f"{i + 1}|Movi\xe9 {i + 1} ({year})|01-Jan-{year}||http://us.imdb.com/M/"
                     f"title-exact?Movie%20{i + 1}|{'|'.join(map(str, flags[i]))}\n")
    return flags, lines


def _pairs(r: np.random.Generator, users: int, items: int, ratings: int) -> np.ndarray:
    """``ratings`` distinct (user, item) pairs, 0-based: active users and popular movies
    rated most (every user at least 20 times, as GroupLens kept them)."""
    activity = r.lognormal(0, 1.0, users)
    popularity = 1.0 / np.arange(1, items + 1) ** 0.8
    popularity = r.permutation(popularity)
    seen: set[tuple[int, int]] = set()
    each = min(20, ratings // users)
    base = [(u, i) for u in range(users) for i in r.choice(items, each, replace=False,
                                                            p=popularity / popularity.sum())]
    seen.update(base)
    while len(seen) < ratings:
        want = 2 * (ratings - len(seen))
        us = r.choice(users, want, p=activity / activity.sum())
        its = r.choice(items, want, p=popularity / popularity.sum())
        for pair in zip(us.tolist(), its.tolist(), strict=True):
            if len(seen) == ratings:
                break
            seen.add(pair)
    return r.permutation(np.array(sorted(seen)))


def truth_logits(truth: Truth, ages: np.ndarray, female: np.ndarray, users: np.ndarray,
                 items: np.ndarray) -> np.ndarray:
    """The planted log-odds that ``users`` (0-based) rate ``items`` 4 or more."""
    group = np.searchsorted(np.asarray(AGE_EDGES), ages[users], side="right")
    genres = truth.genres[items]
    taste = (genres * (truth.genre_gender[:, female[users]].T
                       + truth.genre_age[:, group].T)).sum(1)
    return (0.2 + truth.user_bias[users] + truth.item_bias[items]
            + (truth.user_factors[users] * truth.item_factors[items]).sum(1) + taste)


def write_movielens(folder: Path, *, users: int = 943, items: int = 1682,
                    ratings: int = 100_000, seed: int = 0) -> float:
    """u.data, u.user and u.item in GroupLens' ml-100k format; returns the truth's AUC on
    the test split (the latest 20% by timestamp), the best a model can score there."""
    r = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    ages, female, user_lines = _people(r, users)
    flags, item_lines = _movies(r, items)
    (folder / "u.user").write_text("".join(user_lines), encoding="latin-1")
    (folder / "u.item").write_text("".join(item_lines), encoding="latin-1")
    truth = Truth(r.normal(0, 0.7, users), r.normal(0, 0.9, items),
                  r.normal(0, 0.55, (users, 4)), r.normal(0, 0.55, (items, 4)),
                  flags, r.normal(0, 0.4, (19, 2)), r.normal(0, 0.3, (19, 7)))
    pairs = _pairs(r, users, items, ratings)
    logits = truth_logits(truth, ages, female, pairs[:, 0], pairs[:, 1])
    like = r.random(len(pairs)) < 1 / (1 + np.exp(-logits))
    stars = np.where(like, r.integers(4, 6, len(pairs)), r.integers(1, 4, len(pairs)))
    times = r.integers(FIRST_TIME, LAST_TIME + 1, len(pairs))
    with open(folder / "u.data", "w") as f:
        f.writelines(f"{u + 1}\t{i + 1}\t{s}\t{t}\n"
                     for (u, i), s, t in zip(pairs.tolist(), stars.tolist(), times.tolist(),
                                             strict=True))
    test = np.argsort(times, kind="stable")[len(times) - max(1, round(0.2 * len(times))):]
    return auc(logits[test], like[test])


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC (Mann-Whitney U, ties counted half)."""
    from scipy.stats import rankdata

    ranks = rankdata(scores)
    pos = int(labels.sum())
    neg = len(labels) - pos
    return float((ranks[labels.astype(bool)].sum() - pos * (pos + 1) / 2) / (pos * neg))
