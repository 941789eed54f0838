"""Fast paths for particular devices, built from a loaded reference model (tokenmill.model)."""
