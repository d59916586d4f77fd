"""The run config: YAML files + `key=value` overrides -> one frozen, validated `Config`.

`schema` declares every key (type, default, one-line meaning), `loader` reads and derives, `ranges` and
`structures` check values and parse the nested ones. The package re-exports the loader's API, so callers write
`config.load(argv)` and `config.Config`.
"""

from maxshard.config.loader import *  # noqa: F403 - the loader's API is the package's
from maxshard.config.loader import __all__  # noqa: F401
