"""Finding a module as the import system does, and running code right after a module's own:
the two steps of a post-import hook that does not depend on how the module is installed. Standard
library only, importing nothing of this package (the start-up hook and the patch engine share it).
"""

from __future__ import annotations

import sys

__all__ = ["find_spec_as_imported", "AfterExec"]


def find_spec_as_imported(name: str, path=None, target=None, skip: object = None):
    """The spec the import system would find for `name`: the first finder on sys.meta_path (other
    than `skip`) that returns one -- the path finder, setuptools' editable finder
    (``__editable___*_finder``, what ``pip install -e`` installs), a zip importer's, any other."""
    for finder in list(sys.meta_path):
        if finder is skip:
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue  # a legacy finder with only find_module: the import system skips it too (3.12+)
        spec = find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


class AfterExec:
    """A loader that runs `loader`'s module, then `after(module)`: what a post-import hook needs,
    without changing the loader SGLang's finder returned (it may be shared by other modules).
    The module keeps its own loader (``__loader__``, ``__spec__.loader``)."""

    def __init__(self, loader, after) -> None:
        self.loader, self.after = loader, after

    def create_module(self, spec):
        return self.loader.create_module(spec) if hasattr(self.loader, "create_module") else None

    def exec_module(self, module) -> None:
        module.__loader__ = self.loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        self.loader.exec_module(module)
        self.after(module)

    def __getattr__(self, name):  # get_resource_reader, is_package, get_code, ... of the real loader
        return getattr(self.loader, name)
