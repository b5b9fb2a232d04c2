"""The read endpoint's query check on its own: reads pass, anything else is refused, and the
check cannot be fooled into reading a keyword inside a literal or a comment."""

from __future__ import annotations

import pytest

from trainscope.store.readonly_sql import Refused, check

READS = [
    "SELECT 1",
    "select count() from findings;",
    "  WITH 2 AS x SELECT x * 3",
    "(SELECT 1) UNION ALL (SELECT 2)",
    "SELECT name, value, readonly FROM system.settings LIMIT 10000",
    "SHOW TABLES FROM system",
    "SHOW CREATE TABLE findings",
    "DESCRIBE TABLE function_summaries",
    "DESC findings",
    "EXISTS TABLE findings",
    "EXPLAIN SELECT 1",
    "SELECT 'DROP TABLE x; INSERT' AS s, `update`, \"set\" FROM t",
    "SELECT $$; DROP$$",
    "SELECT {job:String} AS j FORMAT JSONEachRow",
    "SELECT 1e-5, 0x1F, .5, 1_000 -- ; DROP TABLE x",
    "SELECT replaceAll(s, 'a', 'b'), URLHierarchy(u) FROM t /* file('x') */",
    "SELECT 'a\\'; DROP TABLE x --'",
]


@pytest.mark.parametrize("sql", READS)
def test_reads_pass(sql: str) -> None:
    check(sql)


REFUSED = [
    ("", "empty"),
    (";", "empty"),
    ("INSERT INTO t VALUES (1)", "'INSERT' statements"),
    ("SELECT 1; SELECT 2", "multiple statements"),
    ("SELECT 1 SETTINGS max_threads = 1", "SETTINGS clause"),
    ("SELECT 1 INTO OUTFILE 'x'", "OUTFILE"),
    ("SELECT * FROM s3Cluster('c', 'u')", "s3Cluster()"),
    ("SELECT * FROM \"remote\"('h', system.one)", "remote()"),
    ("SELECT 1 /* unterminated", "unterminated"),
    ("SELECT 'x", "unterminated"),
    ("SELECT $a$x", "unterminated heredoc"),
    ("SELECT $", "heredoc"),
    ("SELECT 1x", "malformed number"),
    ("SELECT 1 \\", "'\\\\'"),
    ("SELECT\u20281", "U+2028"),
]


@pytest.mark.parametrize(("sql", "reason"), REFUSED)
def test_everything_else_is_refused_with_its_reason(sql: str, reason: str) -> None:
    with pytest.raises(Refused, match=None) as refused:
        check(sql)
    assert reason in str(refused.value)
