"""The run config: YAML files + `key=value` overrides -> one frozen, validated `Config`.

`schema` declares every key (type, default, one-line meaning), `loader` reads and derives, `ranges` and
`structures` check values and parse the nested ones. The package re-exports the loader's API, so callers write
`config.load(argv)` and `config.Config`.
"""

from maxshard.config.loader import (MESH_AXES, Config, finalize, knob_name, load, load_parsed, parse,
                                    reading_files_once, resolve_path, resolve_paths, user_keys)

__all__ = ["Config", "MESH_AXES", "knob_name", "load", "parse", "finalize", "user_keys", "resolve_path",
           "resolve_paths", "load_parsed", "reading_files_once"]
