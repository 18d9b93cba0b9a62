"""The eviction methods, one file each: every module here registers its classes (``@register``) when
:mod:`kvbench.policies` imports this package, so adding a method means adding a file."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
