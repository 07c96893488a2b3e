"""gqakit's own model classes join transformers' Auto classes when `gqakit` is imported, without importing
transformers (and torch) at that moment: `gqakit --help` stays instant.

`install()` (run by gqakit/__init__.py) registers at once when transformers is already imported, and otherwise
puts a finder on sys.meta_path that registers right after the `transformers` package finishes importing, then
removes itself. Either way, by the time anyone can call `AutoModelForCausalLM.from_pretrained`, gqakit's
`model_type`s are known.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_done = False


def register() -> None:
    """Register every gqakit model class with transformers (idempotent)."""
    global _done
    if _done:
        return
    _done = True
    from gqakit.hf.models import grouped_bigcode, grouped_t5

    grouped_bigcode.register()
    grouped_t5.register()


class _AfterTransformers(importlib.abc.MetaPathFinder):
    """Wraps the loader of the `transformers` package so that `register()` runs once it has executed."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)  # one shot: the real finders locate the package
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            register()
        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if "transformers" in sys.modules:
        register()
    elif not any(isinstance(f, _AfterTransformers) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTransformers())
