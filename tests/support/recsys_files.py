"""Small MovieLens and Criteo files in their publishers' exact layouts, written by the tests."""

from __future__ import annotations

import gzip
import random
from pathlib import Path

OCCUPATIONS = ("administrator", "artist", "student", "writer")


def write_ml100k(folder: Path, *, users: int = 40, items: int = 30, ratings: int = 2000,
                 seed: int = 0) -> Path:
    """An ml-100k folder: u.data, u.user, u.item; users with even ids like even items.

    The timestamps grow with the line, so the test split is the file's last lines.
    """
    r = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "u.user", "w", encoding="latin-1") as f:
        for u in range(1, users + 1):
            zip_code = "T8H1N" if u == 3 else f"{r.randint(0, 99999):05d}"
            f.write(f"{u}|{r.randint(10, 70)}|{'MF'[u % 2]}|{OCCUPATIONS[u % 4]}|{zip_code}\n")
    with open(folder / "u.item", "w", encoding="latin-1") as f:
        for i in range(1, items + 1):
            flags = ["0"] * 19
            flags[i % 19] = flags[(i * 7) % 19] = "1"
            f.write(f"{i}|Movi\xe9 {i} (1995)|01-Jan-1995||http://us.imdb.com/M/title-exact?"
                    f"Movie%20{i}|{'|'.join(flags)}\n")
    with open(folder / "u.data", "w") as f:
        for k in range(ratings):
            u, i = r.randint(1, users), r.randint(1, items)
            like = (u % 2 == i % 2) == (r.random() < 0.9)
            f.write(f"{u}\t{i}\t{r.choice([4, 5]) if like else r.choice([1, 2, 3])}\t"
                    f"{880000000 + k}\n")
    return folder


def criteo_line(r: random.Random) -> str:
    """One line of the display-advertising logs: label, 13 integers, 26 hashed values."""
    ints = ["" if r.random() < 0.2 else str(r.randint(-1, 500)) for _ in range(13)]
    cats = ["" if r.random() < 0.1 else f"{r.getrandbits(32):08x}" for _ in range(26)]
    return "\t".join([str(r.randint(0, 1)), *ints, *cats])


def write_criteo(folder: Path, lines: int = 200, *, gz: bool = False, seed: int = 0) -> Path:
    """``train.txt`` (or ``train.txt.gz``) of ``lines`` random lines in ``folder``."""
    r = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(criteo_line(r) + "\n" for _ in range(lines)).encode()
    path = folder / ("train.txt.gz" if gz else "train.txt")
    path.write_bytes(gzip.compress(text) if gz else text)
    return path
