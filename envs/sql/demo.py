"""A small SQL task set written for this project: a bookshop database and 18 questions.

The database is built by code (:func:`build_database`) into a cache folder the first time it
is needed, so no binary file is committed. Its data is invented. The questions range from a
single-table count to grouped joins with subqueries, and include traps a careless query
falls into: a NULL birth year that sorts first, a book without a genre, an author without
books, customers without orders. Tests recompute every answer from :data:`TABLES` in plain
Python.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sqlite3
import tempfile

from envs.sql.env import SqlTask

DB_ID = "bookshop"

SCHEMA = """\
CREATE TABLE authors (
  author_id INTEGER PRIMARY KEY,
  name TEXT NOT NULL,
  country TEXT NOT NULL,
  birth_year INTEGER
);
CREATE TABLE books (
  book_id INTEGER PRIMARY KEY,
  title TEXT NOT NULL,
  author_id INTEGER NOT NULL REFERENCES authors (author_id),
  genre TEXT,
  year INTEGER NOT NULL,
  price REAL NOT NULL
);
CREATE TABLE customers (
  customer_id INTEGER PRIMARY KEY,
  name TEXT NOT NULL,
  city TEXT NOT NULL
);
CREATE TABLE orders (
  order_id INTEGER PRIMARY KEY,
  customer_id INTEGER NOT NULL REFERENCES customers (customer_id),
  order_date TEXT NOT NULL
);
CREATE TABLE order_items (
  order_id INTEGER NOT NULL REFERENCES orders (order_id),
  book_id INTEGER NOT NULL REFERENCES books (book_id),
  quantity INTEGER NOT NULL,
  PRIMARY KEY (order_id, book_id)
);
"""

# Rows of each table, in the column order of SCHEMA.
TABLES: dict[str, tuple[tuple, ...]] = {
    "authors": (
        (1, "Mara Okafor", "Nigeria", 1958),
        (2, "Tomas Lindqvist", "Sweden", 1971),
        (3, "Ines Duarte", "Portugal", 1983),
        (4, "Hollis Grant", "Canada", 1949),
        (5, "Yuki Sato", "Japan", 1990),
        (6, "Adele Fournier", "Canada", 1966),
        (7, "Piotr Nowak", "Poland", 1977),
        (8, "Lena Brandt", "Germany", None),
    ),
    "books": (
        (1, "The Salt Road", 1, "fantasy", 1987, 12.5),
        (2, "Harbor of Glass", 1, "fantasy", 1994, 14.0),
        (3, "Cold Ledger", 2, "crime", 2003, 9.99),
        (4, "North of Midnight", 2, "crime", 2011, 11.5),
        (5, "The Quiet Orchard", 3, "literary", 2015, 16.0),
        (6, "Paper Lanterns", 3, "poetry", 2019, 8.75),
        (7, "Iron Prairie", 4, "western", 1972, 7.25),
        (8, "The Long Thaw", 4, "literary", 1988, 10.0),
        (9, "Circuit Dreams", 5, "science fiction", 2020, 18.5),
        (10, "Orbit of Ash", 5, "science fiction", 2022, 19.0),
        (11, "Maple and Smoke", 6, "literary", 1999, 13.25),
        (12, "A Map of Small Rivers", 6, "poetry", 2005, 9.5),
        (13, "The Clockmaker's Debt", 8, "crime", 2008, 12.0),
        (14, "Field Notes on Silence", 8, None, 2013, 15.5),
        (15, "Ember Crown", 1, "fantasy", 2001, 17.25),
        (16, "Dust Ledger", 4, "western", 1985, 6.5),
    ),
    "customers": (
        (1, "Ada Mensah", "Lisbon"),
        (2, "Bruno Keller", "Berlin"),
        (3, "Chloe Martin", "Montreal"),
        (4, "Dev Patel", "Toronto"),
        (5, "Elena Rossi", "Lisbon"),
        (6, "Farid Haddad", "Berlin"),
        (7, "Greta Olsen", "Oslo"),
        (8, "Hugo Weber", "Montreal"),
    ),
    "orders": (
        (1, 1, "2022-11-03"),
        (2, 2, "2022-12-15"),
        (3, 1, "2023-01-09"),
        (4, 3, "2023-01-21"),
        (5, 4, "2023-02-02"),
        (6, 5, "2023-02-14"),
        (7, 2, "2023-03-30"),
        (8, 6, "2023-03-31"),
        (9, 3, "2023-05-06"),
        (10, 4, "2024-01-12"),
        (11, 5, "2024-02-20"),
        (12, 1, "2024-03-03"),
    ),
    "order_items": (
        (1, 1, 1),
        (1, 3, 2),
        (2, 9, 1),
        (3, 10, 2),
        (3, 5, 1),
        (4, 11, 1),
        (4, 12, 3),
        (5, 9, 1),
        (5, 4, 1),
        (5, 15, 2),
        (6, 1, 1),
        (7, 13, 1),
        (7, 3, 1),
        (8, 10, 1),
        (9, 6, 2),
        (9, 9, 1),
        (10, 15, 1),
        (10, 7, 1),
        (11, 2, 1),
        (12, 9, 2),
        (12, 14, 1),
    ),
}

# (question, gold query), from easy to hard.
QUESTIONS: tuple[tuple[str, str], ...] = (
    ("How many books does the shop sell?", "SELECT COUNT(*) FROM books"),
    (
        "List the titles of the books published before 1990.",
        "SELECT title FROM books WHERE year < 1990",
    ),
    (
        "Which authors come from Canada? Give their names.",
        "SELECT name FROM authors WHERE country = 'Canada'",
    ),
    (
        "In which cities do the customers live? List each city once.",
        "SELECT DISTINCT city FROM customers",
    ),
    (
        "What is the name of the oldest author, the one with the earliest known birth year?",
        "SELECT name FROM authors WHERE birth_year = (SELECT MIN(birth_year) FROM authors)",
    ),
    (
        "How many books are there in each genre? Give the genre and the number of books, "
        "leaving out books without a genre.",
        "SELECT genre, COUNT(*) FROM books WHERE genre IS NOT NULL GROUP BY genre",
    ),
    (
        "Give the title of each book by an author from Canada, together with the author's name.",
        "SELECT b.title, a.name FROM books AS b JOIN authors AS a ON a.author_id = b.author_id "
        "WHERE a.country = 'Canada'",
    ),
    (
        "What is the average price of the fantasy books?",
        "SELECT AVG(price) FROM books WHERE genre = 'fantasy'",
    ),
    (
        "Give the titles of the three most expensive books, the most expensive first.",
        "SELECT title FROM books ORDER BY price DESC LIMIT 3",
    ),
    (
        "Which authors have no books in the shop? Give their names.",
        "SELECT name FROM authors WHERE author_id NOT IN (SELECT author_id FROM books)",
    ),
    (
        "Which customers have never placed an order? Give their names.",
        "SELECT name FROM customers WHERE customer_id NOT IN (SELECT customer_id FROM orders)",
    ),
    (
        "How many orders were placed in 2023?",
        "SELECT COUNT(*) FROM orders WHERE order_date BETWEEN '2023-01-01' AND '2023-12-31'",
    ),
    (
        "For each customer who has placed an order, give their name and the total number of books "
        "they bought, from the most books to the fewest.",
        "SELECT c.name, SUM(i.quantity) AS total FROM customers AS c "
        "JOIN orders AS o ON o.customer_id = c.customer_id "
        "JOIN order_items AS i ON i.order_id = o.order_id "
        "GROUP BY c.customer_id ORDER BY total DESC",
    ),
    (
        "What is the title of the best-selling book, by total quantity ordered?",
        "SELECT b.title FROM books AS b JOIN order_items AS i ON i.book_id = b.book_id "
        "GROUP BY b.book_id ORDER BY SUM(i.quantity) DESC LIMIT 1",
    ),
    (
        "What was the total revenue, quantity times price, of the orders placed in 2023?",
        "SELECT SUM(i.quantity * b.price) FROM order_items AS i "
        "JOIN books AS b ON b.book_id = i.book_id JOIN orders AS o ON o.order_id = i.order_id "
        "WHERE o.order_date LIKE '2023-%'",
    ),
    (
        "Which genres have an average book price above the average price of all books? "
        "Give the genre names.",
        "SELECT genre FROM books WHERE genre IS NOT NULL GROUP BY genre "
        "HAVING AVG(price) > (SELECT AVG(price) FROM books)",
    ),
    (
        "Which authors have books in more than one genre? Give their names.",
        "SELECT a.name FROM authors AS a JOIN books AS b ON b.author_id = a.author_id "
        "GROUP BY a.author_id HAVING COUNT(DISTINCT b.genre) > 1",
    ),
    (
        "How many orders were placed in each month of 2023? Give the month as a number and the "
        "number of orders, in month order.",
        "SELECT CAST(strftime('%m', order_date) AS INTEGER) AS month, COUNT(*) FROM orders "
        "WHERE order_date LIKE '2023-%' GROUP BY month ORDER BY month",
    ),
)


def build_database(path: str | pathlib.Path) -> pathlib.Path:
    """Write the bookshop database to ``path`` (replacing any file there) and return it.

    The file is built under a temporary name and moved into place, so a concurrent reader
    never sees half a database.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        conn = sqlite3.connect(scratch)
        try:
            conn.executescript(SCHEMA)
            for table, rows in TABLES.items():
                marks = ", ".join("?" * len(rows[0]))
                conn.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
            conn.commit()
        finally:
            conn.close()
        os.replace(scratch, path)
    except BaseException:
        pathlib.Path(scratch).unlink(missing_ok=True)
        raise
    return path


def default_cache_dir() -> pathlib.Path:
    """Where the database is built unless a caller names a folder: one in the system temp dir."""
    return pathlib.Path(tempfile.gettempdir()) / "agentrl-jax-sql"


def database_path(cache_dir: str | pathlib.Path | None = None) -> pathlib.Path:
    """The bookshop database in ``cache_dir``, built if absent. Its name carries a digest of
    the schema and data, so a changed definition never reuses a stale file."""
    digest = hashlib.sha256(repr((SCHEMA, TABLES)).encode()).hexdigest()[:12]
    path = pathlib.Path(cache_dir or default_cache_dir()) / f"{DB_ID}-{digest}.sqlite"
    return path if path.is_file() else build_database(path)


def demo_tasks(cache_dir: str | pathlib.Path | None = None) -> list[SqlTask]:
    """The 18 bookshop tasks, their database built in ``cache_dir`` if needed."""
    path = database_path(cache_dir)
    return [SqlTask(DB_ID, path, question, gold) for question, gold in QUESTIONS]
