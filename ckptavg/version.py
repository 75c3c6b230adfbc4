"""The package version: a leaf, so that the manifest and the CLI name it without importing the package."""

__version__ = "0.1.0"
