"""MovieLens readers: GroupLens' layouts, side features, the time split, bad rows refused."""

from __future__ import annotations

import socket

import pytest
import torch
from recsys_files import write_ml100k

from towerflow.data.movielens import GENRES, find_movielens, load_movielens, movielens_rows
from towerflow.errors import DataLossError, NotFoundError, UnavailableError


def _genre(name: str) -> int:
    return GENRES.index(name) + 1


def test_ml100k_fields_in_order_with_its_side_features(tmp_path) -> None:
    folder = tmp_path / "ml-100k"
    folder.mkdir()
    (folder / "u.data").write_text("1\t2\t5\t100\n3\t1\t2\t200\n1\t1\t4\t300\n2\t2\t3\t400\n"
                                   "3\t2\t1\t500\n")
    (folder / "u.user").write_text("1|24|M|student|85711\n2|53|F|other|94043\n"
                                   "3|17|M|writer|T8H1N\n")
    flags = ["0"] * 19
    (folder / "u.item").write_bytes(
        ("1|Toy Story (1995)|01-Jan-1995||http://us.imdb.com/x|" + "|".join(
            ["0", "0", "0", "1", "1", "1"] + ["0"] * 13) + "\n"
         "2|Les Mis\xe9rables (1995)|01-Jan-1995||http://us.imdb.com/y|" + "|".join(
            flags[:8] + ["1"] + flags[9:]) + "\n").encode("latin-1"))
    train = load_movielens(tmp_path, "train", test_fraction=0.2)
    assert train.names == ("user", "item", "age", "gender", "occupation", "zip", "genres")
    assert train.rows == tuple(movielens_rows("ml-100k").values())
    assert train.rows[:2] == (944, 1683)
    assert train.fields[0].tolist() == [1, 3, 1, 2]
    assert train.fields[1].tolist() == [2, 1, 1, 2]
    assert train.labels.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert train.fields[2].tolist() == [2, 1, 2, 6]  # 18-24, under 18, 18-24, 50-55
    assert train.fields[3].tolist() == [1, 1, 1, 2]  # M M M F
    assert train.fields[4].tolist() == [19, 21, 19, 14]  # student, writer, student, other
    assert train.fields[5].tolist() == [858, 0, 858, 941]  # 1 + "857", not a US zip, 1 + "940"
    drama, animation = _genre("Drama"), _genre("Animation")
    assert train.fields[6][0].tolist() == [drama, 0, 0]  # Les Misérables: Drama, padded
    assert train.fields[6][1].tolist() == [animation, _genre("Children's"), _genre("Comedy")]
    test = load_movielens(tmp_path / "ml-100k", "test", test_fraction=0.2)  # the folder itself
    assert test.fields[0].tolist() == [3] and test.labels.tolist() == [0.0]


def test_the_split_is_by_time_not_by_line(tmp_path) -> None:
    folder = write_ml100k(tmp_path / "ml-100k", ratings=10)
    lines = (folder / "u.data").read_text().splitlines()
    times = list(range(10, 0, -1))  # the first line is the latest
    (folder / "u.data").write_text("".join(
        "\t".join(line.split("\t")[:3] + [str(t)]) + "\n" for line, t in zip(lines, times, strict=True)))
    users = [int(line.split("\t")[0]) for line in lines]
    test = load_movielens(tmp_path, "test", test_fraction=0.2)
    train = load_movielens(tmp_path, "train", test_fraction=0.2)
    assert test.fields[0].tolist() == [users[1], users[0]]
    assert train.fields[0].tolist() == users[2:][::-1]


def test_ml1m_double_colon_latin1_and_joined_genres(tmp_path) -> None:
    folder = tmp_path / "ml-1m"
    folder.mkdir()
    (folder / "ratings.dat").write_text("1::1193::5::978300760\n2::661::3::978302109\n"
                                        "1::661::4::978301968\n")
    (folder / "users.dat").write_text("1::F::1::10::48067\n2::M::56::16::70072\n")
    (folder / "movies.dat").write_bytes(
        "661::James and the Giant Peach (1996)::Animation|Children's|Musical\n"
        "1193::One Flew Over the Cuckoo's Nest (1975)::Drama\n"
        "2::Caf\xe9 (1999)::Comedy\n".encode("latin-1"))
    data = load_movielens(tmp_path, "train", variant="ml-1m", test_fraction=0.34)
    assert data.fields[0].tolist() == [1, 1] and data.fields[1].tolist() == [1193, 661]
    assert data.fields[2].tolist() == [1, 1] and data.fields[3].tolist() == [2, 2]
    assert data.fields[4].tolist() == [11, 11]
    assert data.fields[6][1].tolist() == [_genre("Animation"), _genre("Children's"),
                                          _genre("Musical")]


def test_ml20m_csv_with_its_header_and_quoted_titles(tmp_path) -> None:
    folder = tmp_path / "ml-20m"
    folder.mkdir()
    (folder / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,2,3.5,1112486027\n"
                                        "1,29,4.5,1112484676\n2,2,4.0,1112484819\n")
    (folder / "movies.csv").write_text(
        'movieId,title,genres\n2,Jumanji (1995),Adventure|Children|Fantasy\n'
        '29,"City of Lost Children, The (Cité des enfants perdus, La) (1995)",'
        'Adventure|Drama|Fantasy|Mystery|Sci-Fi\n')
    data = load_movielens(tmp_path, "train", variant="ml-20m", test_fraction=0.34)
    assert data.names == ("user", "item", "genres")
    assert data.fields[1].tolist() == [29, 2] and data.labels.tolist() == [1.0, 1.0]
    assert data.fields[2][0, :5].tolist() == [_genre(g) for g in (
        "Adventure", "Drama", "Fantasy", "Mystery", "Sci-Fi")]
    (folder / "ratings.csv").write_text("user,movie,rating,timestamp\n1,2,3.5,1\n")
    with pytest.raises(DataLossError, match=r"ratings\.csv, line 1: the header is "
                       r"'user,movie,rating,timestamp', not 'userId,movieId,rating,timestamp'"):
        load_movielens(tmp_path, "train", variant="ml-20m")


@pytest.mark.parametrize(("name", "line", "pattern"), [
    ("u.data", "7\t3\tfive\t881250949\n", r"u\.data, line 2: rating 'five' is not a number"),
    ("u.data", "7\t3\t4\n", r"u\.data, line 2: timestamp '' is not an integer"),
    ("u.data", "7\t3\t4\t881250949\t1\n", r"u\.data: .*line 2"),
    ("u.data", "7\t99999\t4\t881250949\n",
     r"u\.data, line 2: movie 99999 is outside ml-100k's published 1\.\.1682"),
    ("u.user", "2|30|X|student|12345\n", r"u\.user, line 2: gender 'X' is not one of M, F"),
    ("u.user", "2|30|M|astronaut|12345\n", r"u\.user, line 2: occupation 'astronaut'"),
])
def test_a_bad_row_is_refused_with_its_file_and_line(tmp_path, name, line, pattern) -> None:
    folder = write_ml100k(tmp_path / "ml-100k", ratings=20)
    first = (folder / name).read_text(encoding="latin-1").splitlines(keepends=True)[0]
    rest = (folder / name).read_text(encoding="latin-1").splitlines(keepends=True)[2:]
    (folder / name).write_text(first + line + "".join(rest), encoding="latin-1")
    with pytest.raises(DataLossError, match=pattern):
        load_movielens(tmp_path, "train")


def test_a_rating_of_an_unknown_movie_names_its_line(tmp_path) -> None:
    folder = write_ml100k(tmp_path / "ml-100k", items=30, ratings=20)
    with open(folder / "u.data", "a") as f:
        f.write("1\t31\t4\t999999999\n")
    with pytest.raises(DataLossError, match=r"u\.data, line 21: movie 31 has no row"):
        load_movielens(tmp_path, "test")


def test_absent_files_name_the_way_out(tmp_path) -> None:
    with pytest.raises(NotFoundError, match=r"ml-100k files u\.data, u\.user, u\.item are not "
                       r"in .*--no-download.*ml-100k\.zip"):
        find_movielens(tmp_path, "ml-100k")


def test_a_failed_download_is_one_sentence_with_the_way_out(tmp_path, monkeypatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    for name in ("https_proxy", "HTTPS_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{port}")
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(name, "")
    with pytest.raises(UnavailableError, match=r"Cannot download MovieLens ml-1m from "
                       r"https://files\.grouplens\.org/datasets/movielens/ml-1m\.zip .*"
                       r"--no-download"):
        load_movielens(tmp_path, variant="ml-1m", download=True)
    assert not list(tmp_path.iterdir())  # no partial file left


def test_the_same_files_give_the_same_tensors(tmp_path) -> None:
    write_ml100k(tmp_path / "ml-100k", ratings=50)
    a, b = load_movielens(tmp_path, "test"), load_movielens(tmp_path, "test")
    assert all(torch.equal(x, y) for x, y in zip(a.fields, b.fields, strict=True))
    assert len(a) == 10
