"""A config dataclass's field docstrings (the string right after each field): the one source of
what a key does, for `main.py --help` and docs/configuration.md alike."""
import ast
import inspect
import textwrap


def field_docs(cls: type) -> dict[str, str]:
    """Each documented field's docstring, by name, on one line: the class's own, and its bases' (a
    config whose keys come in groups of their own: TrainerConfig)."""
    docs = {}
    for base in reversed([c for c in cls.__mro__ if c is not object]):
        docs.update(own_field_docs(base))
    return docs


def own_field_docs(cls: type) -> dict[str, str]:
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        documented = (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                      and isinstance(following.value.value, str))
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and documented:
            docs[node.target.id] = " ".join(inspect.cleandoc(following.value.value).split())
    return docs
