"""The machinery under leviathan.py and its scripts: fast paths, file formats, plumbing; see
docs/layout.md.

Nothing here is needed to read the model: leviathan.py imports nothing from this package, and no
module here imports leviathan.py or a script. Importing the package loads nothing else: each module
imports what it needs.
"""
