import re

from oasiskv.bench.common import markdown_table


def cells(line: str) -> list[str]:
    """A markdown table row's cells, split at the pipes that are not escaped."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_every_row_has_one_cell_per_column_even_with_pipes_in_the_text():
    columns = [("name", "drafter"), ("x", "recall | right"), ("n", "steps")]
    rows = [{"name": "eagle:a|b", "x": 0.92741, "n": 48}, {"name": "resync", "x": None, "n": 3}]
    head, sep, *body = markdown_table(rows, columns).splitlines()
    assert cells(head) == ["drafter", "recall | right", "steps"]
    assert sep == "|---|---|---|"
    assert [cells(line) for line in body] == [["eagle:a|b", "0.927", "48"], ["resync", "", "3"]]
