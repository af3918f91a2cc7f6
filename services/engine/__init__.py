"""The in-process engine and the offline command line built on it."""
