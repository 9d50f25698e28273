"""Flags and `--config FILE.toml` from the settings sections (`tscale_p2p.settings`): each flag is declared once.

A command names the sections it takes (`Command`); each section becomes one group of flags in its `--help`, and
one table of its config file. Values are layered by pydantic-settings: flags over the file over the defaults,
section by section. argparse parses the flags rather than pydantic-settings' own command-line source, which
names a nested field `--section.field` (every flag users know would change), takes a list as `--x a --x b`
rather than `--x a b`, and reports a bad flag in a block rather than the one line this project prints.
"""

from __future__ import annotations

import argparse
import contextvars
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pydantic
from pydantic_settings import BaseSettings, InitSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from tscale_p2p.errors import UserError
from tscale_p2p.settings import field_extra, one_line, section_fields, value_types

# The config file of the settings being built (a source of `CommandSettings`).
_config_file: contextvars.ContextVar[InitSettingsSource | None] = contextvars.ContextVar("config_file", default=None)


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_section_flags(parser: argparse.ArgumentParser, title: str, cls, names: typing.Collection[str]) -> None:
    """One flag per field `names` of section `cls`, in a group of their own. Defaults are suppressed, so that the
    flags given can be told from the rest (they win over the config file)."""
    group = parser.add_argument_group(title)
    for name, info in section_fields(cls).items():
        if name in names:
            _add_flag(group, name, info)


def _add_flag(group, name: str, info: pydantic.fields.FieldInfo) -> None:
    extra, kind = field_extra(info), value_types(info)[0]
    default = None if info.is_required() else info.default
    help_text = (info.description or "").replace("%", "%%")
    if kind is bool:
        action = "store_true" if default is False else argparse.BooleanOptionalAction
        group.add_argument(flag_of(name), action=action, default=argparse.SUPPRESS, help=help_text)
        return
    kwargs: dict = {}
    if extra.get("repeat"):  # --stop a --stop b
        kwargs["action"] = "append"
        item = typing.get_args(kind)[0]
    elif typing.get_origin(kind) is typing.Literal:
        kwargs["choices"] = typing.get_args(kind)
        item = type(kwargs["choices"][0])
    elif typing.get_origin(kind) is tuple:
        kwargs["nargs"] = "+"
        item = typing.get_args(kind)[0]
    else:
        item = kind
    if "const" in extra:
        kwargs.update(nargs="?", const=extra["const"])
    if default not in (None, ()) and "default" not in help_text:
        help_text += f" (default: {default})"
    metavar = extra.get("metavar", None if "choices" in kwargs else name.upper())
    group.add_argument(flag_of(name), type=item, default=argparse.SUPPRESS, metavar=metavar, help=help_text, **kwargs)


class CommandSettings(BaseSettings):
    """One command's settings, a field per section: its flags over its `--config` file over the defaults."""

    model_config = SettingsConfigDict(extra="forbid")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        # Flags, then the file: no environment variables or .env files, a peer's settings are what it was given.
        config_file = _config_file.get()
        return (init_settings,) if config_file is None else (init_settings, config_file)


class ConfigFile(TomlConfigSettingsSource):
    """A `--config` TOML file: a table per section (`[optim]`, `[network]`...), or keys at the top level (the
    flags' names, with dashes or underscores), as long as a key names one setting of the command."""

    def __init__(self, settings_cls: type[CommandSettings], path: str, skip: typing.Collection[str] = (),
                 ignore: typing.Collection[str] = ()) -> None:
        """`skip`: the "table.field" names the command leaves out; `ignore`: the tables whose keys are checked
        but not used."""
        self.path = path
        if not Path(path).is_file():
            raise UserError(f"config file {path!r} does not exist" if not Path(path).exists()
                            else f"config file {path!r} is not a file")
        try:
            super().__init__(settings_cls, toml_file=Path(path))
        except ValueError as error:  # tomllib.TOMLDecodeError
            raise UserError(f"config file {path!r} is not valid TOML: {error}") from None
        except OSError as error:
            raise UserError(f"cannot read config file {path!r}: {error.strerror}") from None
        sections = {name: section_fields(info.annotation) for name, info in settings_cls.model_fields.items()}
        owner = {key: section for section, keys in sections.items() for key in keys if f"{section}.{key}" not in skip}
        self.keys: set[str] = set()  # the settings the file gives: with the flags, those the user chose
        routed: dict[str, dict] = {}
        for key, value in self.toml_data.items():
            name = key.replace("-", "_")
            if name in sections and isinstance(value, dict):
                for inner, inner_value in value.items():
                    setting = inner.replace("-", "_")
                    if owner.get(setting) != name:
                        raise UserError(f"unknown key {inner!r} in [{key}] of config file {path!r}"
                                        + (f" (it belongs in [{owner[setting]}])" if setting in owner else ""))
                    routed.setdefault(name, {})[setting] = inner_value
                    self.keys.add(setting)
            elif name in owner:
                routed.setdefault(owner[name], {})[name] = value
                self.keys.add(name)
            else:
                raise UserError(f"unknown key {key!r} in config file {path!r}")
        for table in ignore:
            self.keys -= set(routed.pop(table, {}))
        self.init_kwargs = routed


@dataclass(frozen=True)
class Command:
    """The sections one command takes, (TOML table name, section class) each, and the fields it leaves out
    ("table.field")."""

    sections: tuple[tuple[str, type], ...]
    skip: frozenset[str] = field(default_factory=frozenset)

    def fields(self, section: str, cls) -> list[str]:
        """The fields of one of its sections that this command takes."""
        return [name for name in section_fields(cls) if f"{section}.{name}" not in self.skip]

    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", metavar="FILE.toml",
                            help="read settings from a TOML file (a [table] per group below); flags override it")
        for name, cls in self.sections:  # a group per section, titled by its table and its docstring's first line
            summary = cls.__doc__.splitlines()[0].rstrip(".")
            add_section_flags(parser, f"{name}: {summary[0].lower()}{summary[1:]}", cls, self.fields(name, cls))

    def load(self, args: argparse.Namespace, ignore: typing.Collection[str] = ()) -> "Loaded":
        """The sections' values (defaults < --config file < flags), checked; UserError naming a bad one. The
        file's tables named in `ignore` are checked for unknown keys, then left out: their sections get flags and
        defaults only."""
        settings_cls = pydantic.create_model(
            "Settings", __base__=CommandSettings,
            **{name: (cls, pydantic.Field(default_factory=cls)) for name, cls in self.sections},
        )
        flags = {name: {key: _plain(getattr(args, key)) for key in self.fields(name, cls) if hasattr(args, key)}
                 for name, cls in self.sections}
        given = {key for values in flags.values() for key in values}
        config_path = getattr(args, "config", None)
        config_file = ConfigFile(settings_cls, config_path, self.skip, ignore) if config_path else None
        token = _config_file.set(config_file)
        try:
            settings = settings_cls(**{name: values for name, values in flags.items() if values})
        except pydantic.ValidationError as error:
            section = error.errors()[0]["loc"][0]
            cls = dict(self.sections)[section]
            raise UserError(one_line(error, cls, lambda key: flag_of(key) if key in given or config_file is None
                                     else f"key {key!r} in config file {config_path!r}")) from None
        finally:
            _config_file.reset(token)
        chosen = given | (config_file.keys if config_file else set())
        return Loaded({name: getattr(settings, name) for name, _ in self.sections}, chosen)


@dataclass(frozen=True)
class Loaded:
    """A command's sections by table name, and the names of the settings the user chose (a flag or a key)."""

    sections: dict[str, object]
    chosen: set[str]

    def __getitem__(self, section: str):
        return self.sections[section]

    def values(self, *sections: str) -> dict:
        """The fields of these sections, one flat dict (what `TrainConfig(**...)` takes)."""
        return {key: getattr(self.sections[s], key) for s in sections for key in section_fields(type(self.sections[s]))}

    def explicit(self, *sections: str) -> dict:
        """The chosen settings of these sections (name -> value)."""
        return {key: value for key, value in self.values(*sections).items() if key in self.chosen}


def _plain(value):
    return tuple(value) if isinstance(value, list) else value
