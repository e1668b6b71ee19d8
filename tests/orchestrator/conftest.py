# Fixtures live in orch_helpers.py (a unique module name: every tests/ folder
# may have a conftest.py, and they are not packages).
from orch_helpers import cli, schema_validator, write_config  # noqa: F401
