"""Which SQL the live read endpoint runs: a read-only check done before the engine sees a query.

The endpoint also runs every query with ClickHouse's ``readonly=1``, but an embedded engine runs
``INTO OUTFILE`` in the serving process and its table functions reach this machine's files, so
the text is checked on its own first. The check tokenises the query the way ClickHouse's lexer
does (quoted strings, quoted identifiers, heredocs and comments are recognised, never searched
for keywords) and refuses, rather than guesses, wherever the two could disagree: a character
outside ASCII or a control character in the query's bare text, an unterminated literal, a nested
block comment, a backslash outside a literal.

What passes: one ``SELECT``, ``WITH … SELECT``, ``SHOW``, ``DESCRIBE``, ``EXISTS`` or
``EXPLAIN`` statement (an optional trailing ``;``), naming no statement keyword of a write, DDL
or setting change anywhere, no ``SETTINGS`` clause, no ``INTO OUTFILE`` / ``FROM INFILE``, and
no function that reaches files, URLs or other servers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ALLOWED_FIRST = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXISTS", "EXPLAIN"})

# Words that only begin or take part in statements that write, change the schema or settings,
# or touch the server; none is needed by a read (a column so named can be quoted: `update`).
FORBIDDEN_WORDS = frozenset({
    "INSERT", "ALTER", "DELETE", "UPDATE", "OPTIMIZE", "TRUNCATE", "CREATE", "DROP", "RENAME",
    "ATTACH", "DETACH", "UNDROP", "EXCHANGE", "SET", "SETTINGS", "KILL", "GRANT", "REVOKE",
    "OUTFILE", "INFILE", "USE", "BACKUP", "RESTORE",
})

# Functions (table functions and scalar ones) that read or write files, URLs, object stores,
# other servers or processes. Compared case-insensitively.
_OUTSIDE_EXACT = frozenset({
    "file", "filecluster", "url", "urlcluster", "input", "mysql", "postgresql", "mongodb",
    "redis", "sqlite", "jdbc", "odbc", "gcs", "oss", "cosn", "arrowflight", "ytsaurus",
    "catboostevaluate", "dictionary", "prometheusquery", "prometheusqueryrange",
})
_OUTSIDE_PREFIXES = (
    "s3", "hdfs", "remote", "cluster", "executable", "iceberg", "deltalake", "hudi", "azure",
    "paimon", "filesystem", "kafka", "nats", "rabbitmq",
)

_WHITESPACE = " \t\n\r\f\v"
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")
_NUMBER = re.compile(
    r"0[xX][0-9A-Fa-f_]+|0[bB][01_]+|(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)"
    r"(?:[eE][+-]?[0-9]+)?"
)
_HEREDOC = re.compile(r"\$([A-Za-z0-9_]*)\$")
_PUNCT = set("()[]{},.;:+-*/%<>=!?|&^~@")


class Refused(ValueError):
    """A query the read endpoint does not run; the text names the reason in one line."""


@dataclass(frozen=True)
class Token:
    """One lexical token: ``word`` (bare identifier or keyword), ``ident`` (quoted identifier,
    unquoted text), ``string``, ``number`` or ``punct``."""

    kind: str
    text: str


def check(sql: str) -> None:
    """Raises :class:`Refused` unless ``sql`` is one read-only statement (see the module)."""
    tokens = tokenize(sql)
    while tokens and tokens[-1] == Token("punct", ";"):
        tokens = tokens[:-1]
    if not tokens:
        raise Refused("empty query")
    if Token("punct", ";") in tokens:
        raise Refused("multiple statements are not allowed: send one statement per request")
    first = next((t for t in tokens if t != Token("punct", "(")), tokens[0])
    head = first.text.upper() if first.kind == "word" else first.text
    if first.kind != "word" or head not in ALLOWED_FIRST:
        raise Refused(
            f"{head[:40]!r} statements are not allowed: only SELECT, WITH … SELECT, SHOW, "
            f"DESCRIBE, EXISTS and EXPLAIN are served (read-only)")
    for i, token in enumerate(tokens):
        _check_token(tokens, i, token, head)


def _check_token(tokens: list[Token], i: int, token: Token, head: str) -> None:
    word = token.text.upper()
    qualified = i > 0 and tokens[i - 1] == Token("punct", ".")  # system.settings is a table
    if token.kind == "word" and word in FORBIDDEN_WORDS and not qualified:
        if word == "CREATE" and head == "SHOW" and i == 1:
            return  # SHOW CREATE TABLE only prints the statement
        what = "a SETTINGS clause" if word == "SETTINGS" else f"{word}"
        raise Refused(f"{what} is not allowed: the endpoint is read-only (no writes, DDL, "
                      f"setting changes or files)")
    followed_by_call = i + 1 < len(tokens) and tokens[i + 1] == Token("punct", "(")
    if token.kind in ("word", "ident") and followed_by_call and reaches_outside(token.text):
        raise Refused(f"function {token.text}() is not allowed: it reaches files, URLs or "
                      f"other servers")


def reaches_outside(name: str) -> bool:
    """Whether a function of this name reads or writes outside the store."""
    low = name.lower()
    return low in _OUTSIDE_EXACT or low.startswith(_OUTSIDE_PREFIXES)


def tokenize(sql: str) -> list[Token]:
    """The tokens of ``sql``, comments and whitespace dropped; :class:`Refused` where the text
    is not plainly lexable."""
    tokens: list[Token] = []
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c in _WHITESPACE:
            i += 1
        elif sql.startswith("--", i) or c == "#":
            end = sql.find("\n", i)
            i = n if end < 0 else end + 1
        elif sql.startswith("/*", i):
            i = _skip_block_comment(sql, i)
        elif c in "'\"`":
            i, text = _quoted(sql, i, c)
            tokens.append(Token("string" if c == "'" else "ident", text))
        elif c == "$":
            i, text = _heredoc(sql, i)
            tokens.append(Token("string", text))
        elif (m := _WORD.match(sql, i)) is not None:
            tokens.append(Token("word", m.group()))
            i = m.end()
        elif (m := _NUMBER.match(sql, i)) is not None:
            i = m.end()
            if i < n and (sql[i].isalnum() or sql[i] in "_$"):
                raise Refused(f"malformed number near {sql[m.start():i + 1]!r}")
            tokens.append(Token("number", m.group()))
        elif c in _PUNCT:
            tokens.append(Token("punct", c))
            i += 1
        else:
            raise Refused(f"character {c!r} (U+{ord(c):04X}) is not allowed outside a quoted "
                          f"string")
    return tokens


def _skip_block_comment(sql: str, i: int) -> int:
    end = sql.find("*/", i + 2)
    if end < 0:
        raise Refused("unterminated /* comment")
    if "/*" in sql[i + 2:end]:
        raise Refused("nested /* comments */ are not allowed")
    return end + 2


def _quoted(sql: str, i: int, quote: str) -> tuple[int, str]:
    """The end and unescaped text of the literal or quoted identifier opening at ``i``."""
    out: list[str] = []
    j, n = i + 1, len(sql)
    while j < n:
        c = sql[j]
        if c == "\\":
            if j + 1 >= n:
                break
            out.append(sql[j + 1])
            j += 2
        elif c == quote:
            if j + 1 < n and sql[j + 1] == quote:
                out.append(quote)
                j += 2
            else:
                return j + 1, "".join(out)
        elif c == "\0":
            raise Refused("a NUL character is not allowed, even quoted")
        else:
            out.append(c)
            j += 1
    raise Refused(f"unterminated {quote}quoted{quote} text")


def _heredoc(sql: str, i: int) -> tuple[int, str]:
    m = _HEREDOC.match(sql, i)
    if m is None:
        raise Refused("'$' is only allowed in a $heredoc$ string")
    end = sql.find(m.group(), m.end())
    if end < 0:
        raise Refused(f"unterminated heredoc {m.group()}")
    return end + len(m.group()), sql[m.end():end]
