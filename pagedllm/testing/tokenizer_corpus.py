"""The tokenizer's training text: docstrings (and source) of standard-library modules.

Standard library only, and run as a script in a fresh interpreter (``python -I -S
tokenizer_corpus.py [--sources]``, see ``checkpoints._training_texts``): libraries imported
into a process replace standard-library attributes (Ray installs its own ``sys.excepthook``,
``logging`` record factory and ``inspect.isgenerator``), which changed the docstrings found
and so the trained vocabulary. In a fresh interpreter the corpus depends on the Python
version alone. Prints a JSON list of strings.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
import sysconfig
import warnings
from typing import Any

# Standard-library modules whose docstrings (and, for large vocabularies, source) make up
# the training text.
_CORPUS_MODULES = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "builtins",
    "calendar", "cmath", "codecs", "collections", "collections.abc", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fnmatch",
    "fractions", "functools", "gc", "getopt", "gettext", "glob", "gzip", "hashlib",
    "heapq", "hmac", "html", "html.parser", "http.client", "http.server", "inspect", "io",
    "ipaddress", "itertools", "json", "locale", "logging", "lzma", "math", "mimetypes",
    "operator", "os", "os.path", "pathlib", "pickle", "pkgutil", "platform", "pprint",
    "queue", "random", "re", "sched", "secrets", "select", "shlex", "shutil", "signal",
    "socket", "sqlite3", "statistics", "string", "struct", "subprocess", "sys", "tarfile",
    "tempfile", "textwrap", "threading", "time", "timeit", "tokenize", "traceback",
    "types", "typing", "unittest", "urllib.parse", "urllib.request", "uuid", "warnings",
    "weakref", "xml.etree.ElementTree", "zipfile", "zlib", "zoneinfo",
)


def _stdlib_docstrings() -> list[str]:
    """Docstrings of the corpus modules and of their public functions, classes and methods."""
    docs: list[str] = []
    seen: set[str] = set()

    def add(doc: Any) -> None:
        if isinstance(doc, str) and doc.strip() and doc not in seen:
            seen.add(doc)
            docs.append(inspect.cleandoc(doc))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # typing.io / typing.re deprecations and the like
        for name in _CORPUS_MODULES:
            try:
                mod = importlib.import_module(name)
            except ImportError:  # pragma: no cover - e.g. a Python built without sqlite3
                continue
            add(mod.__doc__)
            for attr in sorted(vars(mod)):
                obj = vars(mod)[attr]
                if not (inspect.isroutine(obj) or inspect.isclass(obj)):
                    continue
                add(getattr(obj, "__doc__", None))
                if inspect.isclass(obj):
                    for member_name in sorted(vars(obj)):
                        member = vars(obj)[member_name]
                        if inspect.isroutine(member) or isinstance(
                            member, (property, classmethod, staticmethod)
                        ):
                            add(getattr(member, "__doc__", None))
    return docs


def _stdlib_sources() -> list[str]:
    """Source text of the corpus modules (whole packages, test folders excluded)."""
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    files: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in _CORPUS_MODULES:
            try:
                mod = importlib.import_module(name)
            except ImportError:  # pragma: no cover
                continue
            path = getattr(mod, "__file__", None)
            if not path or not path.endswith(".py"):
                continue  # built-in or C extension
            path = os.path.realpath(path)
            if not path.startswith(stdlib):
                continue
            if os.path.basename(path) == "__init__.py":
                for root, dirs, names in os.walk(os.path.dirname(path)):
                    dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "__pycache__"))
                    files.extend(os.path.join(root, n) for n in sorted(names) if n.endswith(".py"))
            else:
                files.append(path)
    texts = []
    for path in dict.fromkeys(files):  # de-duplicate, keep order
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return texts


if __name__ == "__main__":
    texts = _stdlib_docstrings()
    if "--sources" in sys.argv[1:]:
        texts += _stdlib_sources()
    json.dump(texts, sys.stdout)
