"""gqakit's attention names, known to transformers without loading gqakit's kernels until one is called.

`import gqakit.attention` must not import torch or transformers (the command line imports the kinds, in this
package, to parse its flags), yet `AutoModelForCausalLM.from_pretrained(path, attn_implementation="gqakit_tiled")`
must work after it. So `install()` waits, as `gqakit.hf.models.registry` does for gqakit's model classes, until
transformers has defined its interfaces (`AttentionInterface` in `transformers.modeling_utils`,
`AttentionMaskInterface` in `transformers.masking_utils`; at once if they are already imported), and registers
under each name a stand-in that, at its first call, registers the real functions (`registration.register_all`,
`ring.register_ring`), which replace it, and hands the call on. A name that is already registered is left alone;
`use()` registers the real functions itself.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from gqakit.attention.kinds import KINDS

RING = "gqakit_ring"
NAMES = (*(f"gqakit_{kind}" for kind in KINDS), RING)
# the module of transformers that defines each interface -> the name of its global instance there
INTERFACES = {"transformers.modeling_utils": "ALL_ATTENTION_FUNCTIONS",
              "transformers.masking_utils": "ALL_MASK_ATTENTION_FUNCTIONS"}


def _register_real(name: str) -> None:
    if name == RING:
        from gqakit.attention.ring import register_ring

        register_ring()
    else:
        from gqakit.attention.registration import register_all

        register_all()


def _stand_in(interface, name: str):
    def stand_in(*args, **kwargs):
        _register_real(name)
        real = interface[name]
        if real is stand_in:
            raise RuntimeError(f"registering gqakit's attention left {name!r} unregistered")
        return real(*args, **kwargs)

    stand_in.__name__ = f"{name}_on_first_call"
    return stand_in


def _announce(module) -> None:
    """Register a stand-in for every name `module`'s interface does not hold yet."""
    interface = getattr(module, INTERFACES[module.__name__])
    for name in NAMES:
        if name not in interface:
            interface.register(name, _stand_in(interface, name))


class _AfterInterfaces(importlib.abc.MetaPathFinder):
    """Wraps the loaders of the modules in `waiting` so that `_announce` runs once each has executed; removes
    itself when none is left."""

    def __init__(self, waiting: set[str]):
        self.waiting = waiting

    def find_spec(self, name, path=None, target=None):
        if name not in self.waiting:
            return None
        self.waiting.discard(name)
        if not self.waiting:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # the real finders (this one no longer answers for `name`)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _announce(module)
        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Announce the names to the interfaces transformers has defined, and wait for the others; idempotent."""
    waiting = set()
    for module_name in INTERFACES:
        if module_name in sys.modules:
            _announce(sys.modules[module_name])
        else:
            waiting.add(module_name)
    if waiting and not any(isinstance(f, _AfterInterfaces) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterInterfaces(waiting))
