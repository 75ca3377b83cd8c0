"""Loading user extensions named by import path: `pkg.module:attr` or `path/to/file.py:attr`."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def load_object(spec: str, what: str, known: list[str]) -> Any:
    """Import the object named by `spec`; errors name the recipe key (`what`) and the fix."""
    if ":" not in spec:
        raise ValueError(f"{what} `{spec}` is not a registered name ({', '.join(known)}) nor an "
                         "import path like `my_pkg.module:function` or `path/to/file.py:function`")
    module_part, attr = spec.rsplit(":", 1)
    if module_part.endswith(".py"):
        path = Path(module_part)
        if not path.is_file():
            raise ValueError(f"{what} `{spec}`: file {path} does not exist")
        name = f"milepost_user_{abs(hash(path.resolve()))}"
        loader_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            raise ValueError(f"{what} `{spec}`: importing {path} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(module_part)
        except Exception as e:
            raise ValueError(f"{what} `{spec}`: cannot import `{module_part}`: "
                             f"{type(e).__name__}: {e}") from e
    if not hasattr(module, attr):
        raise ValueError(f"{what} `{spec}`: `{module_part}` has no attribute `{attr}`")
    return getattr(module, attr)
