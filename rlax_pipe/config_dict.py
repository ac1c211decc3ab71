"""Frozen config dataclasses <-> `ml_collections.ConfigDict`, and their field documentation.

Experiments are configured by config files (`experiments/configs/<family>.py`, loaded with
`ml_collections.config_flags.DEFINE_config_file`) whose `get_config(preset)` builds a dataclass
(the dataclasses stay the one source of defaults) and returns `to_config_dict(it)`; command-line
overrides (`--config.learner.optimizer.learning_rate=1e-4`) edit the ConfigDict, and
`from_config_dict(RunConfig, config)` rebuilds (and so re-validates) the dataclass; a validation
error becomes a `ConfigError` whose message names the field by its path in the config
(`pipeline.num_steps`, or `--config.pipeline.num_steps` with a flag prefix), so an entry point can
print it as one line. `describe_fields` lists every field with the unit and range written in its
class docstring, for `--helpfull`.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

import ml_collections
from ml_collections import config_dict as config_dict_lib

_SCALARS = (bool, int, float, str)


class ConfigError(ValueError):
  """A user's configuration cannot work; the message names the field(s) and the fix.

  Entry points print it as one line (no traceback). A `ValueError`, so callers that catch
  validation errors keep working.
  """


def name_fields(message: str, cls: type, path: str) -> str:
  """Rewrites "Cls.field" in `message` as "<path>field" for every field of dataclass `cls`.

  E.g. name_fields("PipelineConfig.num_steps=-5 must be >= 1.", PipelineConfig,
  "--config.pipeline.") == "--config.pipeline.num_steps=-5 must be >= 1."
  """
  names = {f.name for f in dataclasses.fields(cls)}

  def sub(match: re.Match) -> str:
    return path + match.group(1) if match.group(1) in names else match.group(0)

  return re.sub(rf"\b{re.escape(cls.__name__)}\.(\w+)", sub, message)


def _optional_scalar(hint: Any) -> type:
  """The scalar type of `X | None` (object for anything else: parsed as a Python literal)."""
  args = [a for a in typing.get_args(hint) if a is not type(None)]
  if len(args) == 1 and args[0] in _SCALARS:
    return args[0]
  return object


def to_config_dict(config: Any) -> ml_collections.ConfigDict:
  """A ConfigDict mirroring a (nested) config dataclass instance.

  Nested dataclasses become nested ConfigDicts; a field whose value is None becomes a typed
  placeholder (from the field's annotation, e.g. `int | None` -> an int placeholder) so it can be
  overridden from the command line.

  Raises:
    TypeError: if `config` is not a dataclass instance.
  """
  if not dataclasses.is_dataclass(config) or isinstance(config, type):
    raise TypeError(f"to_config_dict needs a dataclass instance, got {type(config).__name__}.")
  hints = typing.get_type_hints(type(config))
  out = ml_collections.ConfigDict()
  for f in dataclasses.fields(config):
    value = getattr(config, f.name)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
      out[f.name] = to_config_dict(value)
    elif value is None:
      out[f.name] = config_dict_lib.placeholder(_optional_scalar(hints[f.name]))
    else:
      out[f.name] = value
  return out


def _dataclass_of(hint: Any) -> type | None:
  if dataclasses.is_dataclass(hint):
    return hint
  for arg in typing.get_args(hint):
    if dataclasses.is_dataclass(arg):
      return arg
  return None


def _is_tuple_hint(hint: Any) -> bool:
  if typing.get_origin(hint) is tuple:
    return True
  return any(typing.get_origin(a) is tuple for a in typing.get_args(hint))


def _deep_tuple(x: Any) -> Any:
  if isinstance(x, (list, tuple)):
    return tuple(_deep_tuple(v) for v in x)
  return x


def _plain(value: Any) -> Any:
  """A ConfigDict as a dict; lists (JSON, the command line) as tuples, inside dicts too, so a
  config read back from config.json equals the one written."""
  if isinstance(value, ml_collections.ConfigDict):
    value = value.to_dict()
  if isinstance(value, dict):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return tuple(_plain(v) for v in value)
  return value


def from_config_dict(cls: type, config: Any, *, prefix: str = "") -> Any:
  """Rebuilds a `cls` instance (validated by its `__post_init__`) from a ConfigDict or dict.

  Nested dataclass fields recurse; tuple fields get tuples (lists from YAML or the command line
  are converted, so the result stays hashable); fields the config omits keep `cls` defaults.

  Args:
    cls: the config dataclass.
    config: its fields (ConfigDict or mapping).
    prefix: how the fields of `cls` are spelled to the user, e.g. "--config." for a command
      line; nested fields get "<prefix><field>.".

  Raises:
    ConfigError: on a key `cls` has no field for (the message lists the valid names; for a
      field listed in the class's optional `REMOVED_FIELDS` mapping, name -> what to set
      instead, it says that instead), or
      whatever the dataclasses' own checks raise, with "Cls.field" rewritten as
      "<prefix>field" (`name_fields`; kept as written for `cls` itself when prefix is "").
  """
  items = dict(config.items()) if hasattr(config, "items") else dict(config)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(items) - names)
  removed = getattr(cls, "REMOVED_FIELDS", {})
  if any(k in removed for k in unknown):
    where = prefix or f"{cls.__name__}."
    raise ConfigError("; ".join(f"{where}{k} was removed: {removed[k]}"
                                for k in unknown if k in removed) + ".")
  if unknown:
    where = prefix.rstrip(".") or cls.__name__
    raise ConfigError(f"{where} has no field(s) {unknown}; valid: {sorted(names)}.")
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for name, value in items.items():
    sub = _dataclass_of(hints[name])
    if sub is not None and value is not None and not dataclasses.is_dataclass(value):
      kwargs[name] = from_config_dict(sub, value, prefix=f"{prefix}{name}.")
    elif _is_tuple_hint(hints[name]):
      kwargs[name] = _deep_tuple(value)
    else:
      kwargs[name] = _plain(value)
  try:
    return cls(**kwargs)
  except (ValueError, TypeError) as e:
    message = name_fields(str(e), cls, prefix) if prefix else str(e)
    raise ConfigError(message) from None if isinstance(e, ConfigError) else e


def field_docs(cls: type) -> dict[str, str]:
  """{field name: its description} from the "Attributes:" section of `cls`'s docstring.

  Several names may share one entry ("a, b: ..."); continuation lines are joined.
  """
  doc = (cls.__doc__ or "").expandtabs()
  match = re.search(r"^(\s*)Attributes:\s*$", doc, re.M)
  if not match:
    return {}
  out, current, indent = {}, None, None
  for line in doc[match.end():].splitlines():
    if not line.strip():
      continue
    width = len(line) - len(line.lstrip())
    if indent is None:
      indent = width
    if width < indent:
      break
    entry = re.match(r"^([\w, ]+):\s*(.*)$", line.strip()) if width == indent else None
    if entry:
      current = [n.strip() for n in entry.group(1).split(",")]
      for n in current:
        out[n] = entry.group(2)
    elif current:
      for n in current:
        out[n] += " " + line.strip()
  return out


def describe_fields(config: Any, prefix: str = "") -> list[str]:
  """One line per (nested) field of a config instance: "path: description [value]".

  Args:
    config: a config dataclass instance (its values are shown, e.g. a preset's).
    prefix: prepended to every path (e.g. "config.").
  """
  cls = type(config)
  docs, lines = field_docs(cls), []
  for f in dataclasses.fields(config):
    path = f"{prefix}{f.name}"
    value = getattr(config, f.name)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
      lines.append(f"{path}: {docs.get(f.name, '(no description)')}")
      lines.extend(describe_fields(value, f"{path}."))
    else:
      lines.append(f"{path}: {docs.get(f.name, '(no description)')} [{value!r}]")
  return lines


__all__ = ["ConfigError", "describe_fields", "field_docs", "from_config_dict", "name_fields",
           "to_config_dict"]
