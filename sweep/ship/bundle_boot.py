"""The import hook at the top of an exported ``train.py``; :mod:`sweep.ship.bundle` inlines this file's text.

A submission is one file, so the ``model`` and ``kernels`` packages travel inside it as source text and
this finder serves them to ``import``. It implements ``get_source`` and fills ``linecache`` so that
tracebacks, ``inspect.getsource`` and NKI's ``@nki.jit`` (which parses its kernels' source) see the
real text. Standard library only: it runs before anything else is importable.
"""

import base64
import importlib.abc
import importlib.util
import linecache
import os
import sys
import zlib

BUNDLE_ATTR = "__trnsweep_bundle__"  # set on every bundled module: which bundle it came from


def unpack(text: str) -> str:
    """A module's source from its compressed form (the bundle's ``zlib`` encoding)."""
    return zlib.decompress(base64.b85decode(text)).decode("utf-8")


class BundleFinder(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Finds and loads the bundled modules: ``{dotted name: (is package, source)}``."""

    def __init__(self, modules: dict, bundle_id: str, origin: str) -> None:
        self.modules = modules
        self.bundle_id = bundle_id
        self.origin = origin  # a directory the file names hang under (they need not exist)

    def filename(self, fullname: str) -> str:
        parts = fullname.split(".")
        if self.modules[fullname][0]:
            return os.path.join(self.origin, *parts, "__init__.py")
        return os.path.join(self.origin, *parts[:-1], parts[-1] + ".py")

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.modules:
            return None
        spec = importlib.util.spec_from_loader(fullname, self, origin=self.filename(fullname),
                                               is_package=self.modules[fullname][0])
        spec.has_location = True  # __file__ = the name tracebacks and inspect use
        return spec

    def create_module(self, spec):
        return None

    def get_code(self, fullname: str):
        return self.source_to_code(self.get_source(fullname), self.filename(fullname))

    def exec_module(self, module) -> None:
        name = module.__name__
        source = self.get_source(name)
        filename = self.filename(name)
        # mtime None: linecache.checkcache keeps the entry although no such file exists.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        setattr(module, BUNDLE_ATTR, self.bundle_id)
        super().exec_module(module)  # the standard loader path: get_code, then run it in the module

    def is_package(self, fullname: str) -> bool:
        return self.modules[fullname][0]

    def get_source(self, fullname: str) -> str:
        if fullname not in self.modules:
            raise ImportError(f"{fullname} is not in this bundle", name=fullname)
        return self.modules[fullname][1]


def install(modules: dict, bundle_id: str, origin: str) -> None:
    """Put the finder first on ``sys.meta_path`` (once), refusing if a same-named package is loaded already."""
    for name in modules:
        have = sys.modules.get(name)
        if have is not None and getattr(have, BUNDLE_ATTR, None) != bundle_id:
            where = getattr(have, "__file__", None) or "elsewhere"
            raise ImportError(f"train.py: module {name!r} is already imported from {where}; "
                              "the bundled one cannot load beside it")
    if not any(getattr(f, "bundle_id", None) == bundle_id for f in sys.meta_path):
        sys.meta_path.insert(0, BundleFinder(modules, bundle_id, origin))
