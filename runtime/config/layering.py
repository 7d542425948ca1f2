"""The one way a configuration is read from its sources and layered: flags > environment >
TOML file > defaults.

A `Layering` describes one configuration's sources (its TOML table, each key's environment
variable, its aliases, the variables it refuses because they were renamed, the flags' name in
errors) and turns each source into the keyword
arguments of the configuration's constructor, checked key by key by the configuration's own
``coerce``. ``None`` among the flags means "not given" (argparse's default) and masks nothing. A
key given by its alias in one layer and its name in another is one key: the higher layer wins;
the two within one source, with different values, are an error. Every problem is a
`ConfigError` naming the source: the file and table, the variable, or the flag.
`paramsync.runtime.train_config.DistributedTrainConfig` and
`paramsync.runtime.parallel.config.ParallelismConfig` both resolve through it.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from paramsync.runtime.errors import ConfigError

__all__ = ["Coerce", "Layering"]

Coerce = Callable[[str, object, str], object]
"""``coerce(key, value, label)``: ``value`` checked (and converted) for ``key``, or a
`ConfigError` naming ``label`` (the source and the key: ``"environment variable PARAMSYNC_X x"``,
``"run.toml [table] x"``, ``"flag x"``)."""


class Layering:
    """One configuration's sources. ``fields``: the keys a source may give (the constructor's
    keyword arguments); ``aliases``: other names of some of them (alias -> field); ``env_vars``:
    each key's (or alias's) environment variable; ``renamed_env``: variables no longer read,
    each with the variable that replaced it (one that is set is a `ConfigError` saying so, not
    silently ignored); ``paths``: keys holding file paths, which a TOML file gives relative to
    itself; ``flag_source``: how errors name the flags' layer;
    ``env_extra``: values the environment gives in other ways than one variable per key (read
    after those, so they win)."""

    def __init__(
        self,
        *,
        table: str,
        fields: Sequence[str],
        coerce: Coerce,
        env_vars: Mapping[str, str],
        aliases: Mapping[str, str] | None = None,
        renamed_env: Mapping[str, str] | None = None,
        paths: Collection[str] = (),
        flag_source: str = "flag",
        env_extra: Callable[[Mapping[str, str]], dict[str, Any]] | None = None,
    ) -> None:
        self.table = table
        self.fields = tuple(fields)
        self.coerce = coerce
        self.env_vars = dict(env_vars)
        self.aliases = dict(aliases or {})
        self.renamed_env = dict(renamed_env or {})
        self.paths = frozenset(paths)
        self.flag_source = flag_source
        self.env_extra = env_extra

    def layer(self, values: Mapping[object, object], where: str) -> dict[str, Any]:
        """One source's ``values``, each checked, aliases folded into their field. ``where``
        names the source in every error."""
        out: dict[str, Any] = {}
        given: dict[str, tuple[str, object]] = {}
        for key, value in values.items():
            if not isinstance(key, str) or (key not in self.fields and key not in self.aliases):
                known = ", ".join((*self.fields, *self.aliases))
                raise ConfigError(f"{where}: unknown key {key!r} (known keys: {known})")
            checked = self.coerce(key, value, f"{where} {key}")
            target = self.aliases.get(key, key)
            if target in given and given[target][1] != checked:
                first, first_value = given[target]
                raise ConfigError(
                    f"{where}: {first}={first_value!r} and {key}={checked!r} name the same "
                    f"field {target} with different values"
                )
            given[target] = (key, checked)
            out[target] = checked
        return out

    def from_env(self, environ: Mapping[str, str]) -> dict[str, Any]:
        """The environment's layer: each key's variable that is set, then ``env_extra``. A
        renamed variable that is still set is a `ConfigError` naming its new name."""
        for old, new in self.renamed_env.items():
            if old in environ:
                raise ConfigError(
                    f"environment variable {old} was renamed {new}: set {new} instead and "
                    f"unset {old}"
                )
        out: dict[str, Any] = {}
        seen: dict[str, str] = {}
        for key, var in self.env_vars.items():
            if var not in environ:
                continue
            target = self.aliases.get(key, key)
            value = self.layer({key: environ[var]}, f"environment variable {var}")[target]
            if target in out and out[target] != value:
                raise ConfigError(
                    f"environment variables {seen[target]}={out[target]!r} and {var}={value!r} "
                    f"name the same field {target} with different values"
                )
            out[target] = value
            seen[target] = var
        if self.env_extra is not None:
            out.update(self.env_extra(environ))
        return out

    def from_toml(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """The TOML file's layer: its ``[table]`` (none: nothing); other tables are left to
        other readers. A path a key holds is relative to the file."""
        path = Path(path)
        try:
            with path.open("rb") as fh:
                data = tomllib.load(fh)
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
        table = data.get(self.table, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: '{self.table}' must be a table, got {table!r}")
        out = self.layer(table, f"{path} [{self.table}]")
        for key in self.paths & out.keys():
            out[key] = path.parent / out[key]
        return out

    def from_flags(self, overrides: Mapping[str, object]) -> dict[str, Any]:
        """The flags' layer: ``None`` values are flags not given."""
        given: dict[object, object] = {k: v for k, v in overrides.items() if v is not None}
        return self.layer(given, self.flag_source)

    def resolve(
        self,
        toml_path: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
        overrides: Mapping[str, object] | None = None,
    ) -> dict[str, Any]:
        """The layers merged: ``overrides`` (flags) > ``environ`` (default ``os.environ``; ``{}``
        ignores it) > the TOML file (None: none) > the constructor's defaults."""
        merged: dict[str, Any] = {}
        if toml_path is not None:
            merged.update(self.from_toml(toml_path))
        merged.update(self.from_env(os.environ if environ is None else environ))
        if overrides is not None:
            merged.update(self.from_flags(overrides))
        return merged
