"""common/field_docs.py: a config dataclass's field docstrings, the one source of `main.py --help` and
docs/configuration.md (test_main.py holds both to every key of TrainConfig)."""
from dataclasses import dataclass

from mingpt.common.field_docs import field_docs


@dataclass
class Settings:
    """The class's own docstring is no field's."""

    width: int = 8
    """Columns per row,
        over two indented lines."""
    height: int = 2
    depth = 3
    """A plain class attribute: not a field, not a key."""
    name: str = "grid"
    label: str = "x"
    "One line, single-quoted."

    def area(self) -> int:
        """A method's docstring is no field's."""
        return self.width * self.height


def test_each_documented_field_gets_its_docstring_on_one_line():
    assert field_docs(Settings) == {"width": "Columns per row, over two indented lines.",
                                    "label": "One line, single-quoted."}


def test_a_field_without_a_docstring_is_left_out_not_given_the_next_one():
    """height and name are followed by another statement, not a string: a key the docs must flag as
    undocumented (test_main's check), never one that borrows its neighbour's words."""
    docs = field_docs(Settings)
    assert "height" not in docs and "name" not in docs and "depth" not in docs
