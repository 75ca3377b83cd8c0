"""Loading user extensions named by import path: `pkg.module:attr` or `path/to/file.py:attr`."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from milepost.core.errors import UserError


class PluginError(UserError):
    """A recipe names an extension that cannot be loaded or has the wrong shape."""


def load_object(spec: str, what: str, known: list[str]) -> Any:
    """Import the object named by `spec`; errors name the recipe key (`what`) and the fix."""
    if ":" not in spec:
        raise PluginError(f"{what} `{spec}` is not a registered name ({', '.join(known)}) nor an "
                          "import path like `my_pkg.module:function` or `path/to/file.py:function`")
    module_part, attr = spec.rsplit(":", 1)
    if not module_part or not attr:
        raise PluginError(f"{what} `{spec}`: both sides of `:` are needed, e.g. `my_pkg.module:function` "
                          "or `path/to/file.py:function`")
    module = _load_file(spec, module_part, what) if module_part.endswith(".py") else \
        _import_module(spec, module_part, what)
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise PluginError(f"{what} `{spec}`: `{module_part}` has no attribute `{attr}`; "
                          f"its functions: {', '.join(public[:20]) or '(none)'}")
    return getattr(module, attr)


def _load_file(spec: str, module_part: str, what: str) -> Any:
    path = Path(module_part)
    if not path.is_file():
        raise PluginError(f"{what} `{spec}`: file {path} does not exist; give the path from the folder "
                          "milepost runs in, or an absolute path")
    name = f"milepost_user_{abs(hash(path.resolve()))}"
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
    try:
        loader_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # a user file may call sys.exit() at import
        sys.modules.pop(name, None)
        raise PluginError(f"{what} `{spec}`: importing {path} failed: {type(e).__name__}: {e}; "
                          "fix the file (run `python " f"{path}` to see the full error)") from e
    return module


def _import_module(spec: str, module_part: str, what: str) -> Any:
    try:
        return importlib.import_module(module_part)
    except (Exception, SystemExit) as e:
        raise PluginError(f"{what} `{spec}`: cannot import `{module_part}`: {type(e).__name__}: {e}; "
                          "install the package or fix the module path") from e
