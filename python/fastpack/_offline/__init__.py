"""The corpus-on-disk machinery of the ``fastpack`` command, one module per pass:
:mod:`.driver` (``fastpack pack``, read it first) runs :mod:`.scan` (lengths), :mod:`.plan`,
:mod:`.gather` and :mod:`.report` over the inputs (:mod:`.sources`) into the output
directory (:mod:`.outdir`, shards laid out by :mod:`.layout`) under :mod:`.settings`;
``fastpack stats`` is the lengths pass and :mod:`.stats`; ``fastpack.ray`` runs the same
passes on a cluster. docs/architecture.md places it among fastpack's layers.

Kept free of imports, so that a command importing one module pays for that one only.
"""
