"""Reading the config's YAML: PyYAML's SafeLoader with `1e-3` read as a float, a key given twice refused, and an
integer too long for Python named with its line (a one-line ConfigError in `harness.config.load_config`)."""

from __future__ import annotations

import re
import sys

import yaml


class Loader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-3 / 3E-4 as floats (YAML 1.2; PyYAML's 1.1 rules want a dot: 1.0e-3), and
    refuses a key given twice in one mapping (PyYAML would keep the last one without a word)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first != key_node.start_mark.line + 1:
                raise DuplicateKey(key, first, key_node.start_mark)
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            raise TooLong(node) from None


class TooLong(yaml.constructor.ConstructorError):
    def __init__(self, node):
        digits = sum(c.isdigit() for c in str(node.value))
        self.problem = f"an integer of {digits} digits (Python reads at most {sys.get_int_max_str_digits()})"
        super().__init__(None, None, self.problem, node.start_mark)


Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key, first_line: int, mark):
        self.problem = f"key '{key}' given twice, first on line {first_line}"
        self.problem_mark = mark
        super().__init__(self.problem)


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_yaml(text: str):
    return yaml.load(text, Loader=Loader)


def key_lines(text: str) -> dict[str, int]:
    """Each section and `section.key` of a recipe's text -> its line (1-based), for the errors that name them; {}
    where the text is not a mapping of mappings."""
    try:
        node = yaml.compose(text, Loader=Loader)
    except (yaml.YAMLError, RecursionError):
        return {}
    lines: dict[str, int] = {}
    for key, value in node.value if isinstance(node, yaml.MappingNode) else ():
        lines[str(key.value)] = key.start_mark.line + 1
        for sub, _ in value.value if isinstance(value, yaml.MappingNode) else ():
            lines[f"{key.value}.{sub.value}"] = sub.start_mark.line + 1
    return lines
