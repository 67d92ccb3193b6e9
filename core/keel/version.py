"""Version of the core distribution and of the plugin API it offers.

`CORE_API_VERSION` is what a plugin manifest's `core_api` range is checked against. It changes major
when a protocol changes incompatibly; protocol inputs are frozen dataclasses that only grow, so adding
a field is a minor bump.
"""

__version__ = "0.1.0"
CORE_API_VERSION = "1.0"
