"""rlk's version: the one place the Python code reads it (``rlk.__version__``); ``VERSION`` at the repository root
is the release's single source, and ``tools/set_version.py`` writes it here and into every pyproject."""

__version__ = "0.1.0"
