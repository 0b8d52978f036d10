"""corral's built-in plugins, one module each, registered by ``supervisor.plugins``."""
