"""A quickstart-style Flower app (see ../pyproject.toml)."""
