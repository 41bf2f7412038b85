"""preprocess package."""
