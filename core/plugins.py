"""The one resolver of extension points: a registered name, `pkg.module:attr` or `path/to/file.py:attr`.

Every kind of plugin (rollout, reward, advantage, loss, filter, hook) is a `Registry` keyed by
the recipe field that names it and typed by a Protocol whose `__call__` is the signature a
plugin must have. Built-ins register themselves in their registry at import; a user's import
path goes through the same `resolve`, which checks the object against the Protocol (callable,
synchronous, its parameters bind to the Protocol's) before anything starts, so a wrong
signature fails at start-up naming the field, the plugin, the expected signature and the fix.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Generic, TypeVar, cast

from milepost.core.errors import UserError

F = TypeVar("F", bound=Callable[..., object])


class PluginError(UserError):
    """A recipe names an extension that cannot be loaded or has the wrong shape."""


def expected_signature(protocol: type) -> str:
    """`fn(a: A, b: B) -> R`, read from the Protocol's `__call__` (what the messages show)."""
    signature = inspect.signature(protocol.__call__)
    params = list(signature.parameters.values())[1:]  # without self
    shown = ", ".join(f"{p.name}: {_shown(p.annotation)}" if p.annotation is not p.empty else p.name
                      for p in params)
    ret = signature.return_annotation
    return f"fn({shown})" + (f" -> {_shown(ret)}" if ret is not inspect.Signature.empty else "")


def _shown(annotation: object) -> str:
    # Protocol modules use `from __future__ import annotations`: annotations are their source text.
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))


def _parameter_names(protocol: type) -> list[str]:
    return list(inspect.signature(protocol.__call__).parameters)[1:]


def check_plugin(obj: object, spec: str, key: str, protocol: type) -> None:
    """What can be known before the first call: callable, synchronous, and its parameters
    take the Protocol's arguments positionally. Raises PluginError naming `key`, `spec`, the
    expected signature and the fix."""
    want = expected_signature(protocol)
    names = _parameter_names(protocol)
    if not callable(obj):
        raise PluginError(f"{key} `{spec}` is a {type(obj).__name__}, not callable; name a function {want}")
    if inspect.iscoroutinefunction(obj) or inspect.isasyncgenfunction(obj) or inspect.isgeneratorfunction(obj):
        raise PluginError(f"{key} `{spec}` is an async or generator function, which returns no result when "
                          f"called; make it a plain `def {want}`")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return  # some builtins have no inspectable signature; the first call checks them
    try:
        signature.bind(*names)
    except TypeError as e:
        raise PluginError(f"{key} `{spec}` must accept ({', '.join(names)}): {e}; change its signature "
                          f"to {want}") from None


class Registry(Mapping[str, F], Generic[F]):
    """The plugins of one extension point: built-ins by name, anything else by import path.

    `key` is the recipe field that names them (it starts every error message); `protocol`
    is the signature they must have. A Mapping of the registered names, so callers can list
    and look them up; `resolve` is the only way from a recipe value to a checked callable.
    """

    def __init__(self, key: str, protocol: type) -> None:
        self.key, self.protocol = key, protocol
        self._builtin: dict[str, F] = {}
        self._resolved: dict[str, F] = {}  # spec -> checked plugin: a file is executed once per process

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: `@REGISTRY.register("name")`; checks the built-in like any plugin."""
        def add(fn: F) -> F:
            assert name not in self._builtin, f"{self.key}: `{name}` registered twice"
            assert ":" not in name, f"{self.key}: `{name}` would read as an import path"
            check_plugin(fn, name, self.key, self.protocol)
            self._builtin[name] = fn
            return fn
        return add

    def resolve(self, spec: str) -> F:
        """The plugin `spec` names, checked against the Protocol. Raises PluginError."""
        found = self._builtin.get(spec) or self._resolved.get(spec)
        if found is not None:
            return found
        obj = load_object(spec, what=self.key, known=sorted(self._builtin))
        check_plugin(obj, spec, self.key, self.protocol)
        self._resolved[spec] = cast(F, obj)
        return cast(F, obj)

    @property
    def signature(self) -> str:
        return expected_signature(self.protocol)

    def __getitem__(self, name: str) -> F:
        return self._builtin[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._builtin)

    def __len__(self) -> int:
        return len(self._builtin)


def portable_spec(spec: str) -> str:
    """`spec` with a relative `file.py` made absolute, for processes that may run in another
    folder (trainer rank actors); names and module paths are returned unchanged."""
    module_part, sep, attr = spec.rpartition(":")
    if sep and module_part.endswith(".py") and not Path(module_part).is_absolute():
        return f"{Path(module_part).resolve()}:{attr}"
    return spec


def load_object(spec: str, what: str, known: list[str]) -> object:
    """Import the object named by `spec`; errors name the recipe key (`what`) and the fix."""
    if ":" not in spec:
        close = difflib.get_close_matches(spec, known, n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else ""
        raise PluginError(f"{what} `{spec}` is not a registered name ({', '.join(known)}){hint} nor an "
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


def _load_file(spec: str, module_part: str, what: str) -> ModuleType:
    path = Path(module_part)
    if not path.is_file():
        raise PluginError(f"{what} `{spec}`: file {path} does not exist; give the path from the folder "
                          "milepost runs in, or an absolute path")
    name = f"milepost_user_{abs(hash(path.resolve()))}"
    if name in sys.modules:  # one file, one module: plugins of several kinds in a file share its state
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    assert loader_spec is not None and loader_spec.loader is not None, path
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
    try:
        loader_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # a user file may call sys.exit() at import
        sys.modules.pop(name, None)
        raise PluginError(f"{what} `{spec}`: importing {path} failed: {type(e).__name__}: {e}; "
                          "fix the file (run `python " f"{path}` to see the full error)") from e
    return module


def _import_module(spec: str, module_part: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module_part)
    except (Exception, SystemExit) as e:
        raise PluginError(f"{what} `{spec}`: cannot import `{module_part}`: {type(e).__name__}: {e}; "
                          "install the package or fix the module path") from e
