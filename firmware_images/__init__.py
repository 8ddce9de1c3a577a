"""The firmware image tool (``aisynergy firmware``: build, sign, inspect) and sample images; see README.md."""
