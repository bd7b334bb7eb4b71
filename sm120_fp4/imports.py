"""Finding a module as the import system does, and running code right after a module's own: a post-import hook
independent of how the module is installed. Stdlib only, importing nothing of ours."""

from __future__ import annotations

import sys


def find_spec_as_imported(name: str, path=None, target=None, skip: object = None):
    """Return the spec the import system would find for `name` (the first finder but `skip` that has one)."""
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
    """A loader that runs `loader`'s module, then `after(module)`; the module keeps its own loader."""

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
