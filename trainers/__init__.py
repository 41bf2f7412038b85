"""trainers package."""
