import re
import typing

from trainscope.schemas.whatif import DDL, TABLE_STRUCTS

CLICKHOUSE_FOR = {int: ("Int", "UInt"), float: ("Float",), str: ("String", "LowCardinality")}


def ddl_columns(ddl: str) -> dict[str, str]:
    return dict(re.findall(r"^\s+`(\w+)` (.+?),?$", ddl, flags=re.M))


def test_every_table_has_a_struct():
    assert set(DDL) == set(TABLE_STRUCTS)


def test_ddl_columns_are_the_struct_fields_in_order():
    for table, struct in TABLE_STRUCTS.items():
        assert list(ddl_columns(DDL[table])) == list(struct.__struct_fields__), table


def test_ddl_types_fit_the_field_types():
    for table, struct in TABLE_STRUCTS.items():
        hints = typing.get_type_hints(struct)
        for name, ctype in ddl_columns(DDL[table]).items():
            hint = hints[name]
            origin = typing.get_origin(hint)
            if origin is dict:
                assert ctype.startswith("Map(String, Float64"), (table, name, ctype)
            elif origin is list:
                assert ctype.startswith("Array(String"), (table, name, ctype)
            else:
                assert ctype.startswith(CLICKHOUSE_FOR[hint]), (table, name, ctype)


def test_tables_replace_duplicates():
    assert "ORDER BY (job_id, step, stage, dp_rank, optype, seq_id)" in DDL["op_traces"]
    assert "ORDER BY (job_id, analysed_at_ns)" in DDL["whatif_results"]
    for ddl in DDL.values():
        assert "ENGINE = ReplacingMergeTree" in ddl
